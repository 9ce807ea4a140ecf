"""Seed 004's futures as presets, their losses on tiny tensors: sft_o1 (no negative gradient) and
grpo_no_is (no importance ratio: the length-normalized weighted log-likelihood of SimPO's route)."""

import torch

from grpolab import config as C
from grpolab.algo.advantages import make_advantage_fn
from grpolab.algo.losses import AGGREGATIONS, POLICY_LOSSES, RATIO_FREE


def _preset_loss(name, logp, old, rewards, mask):
    """The preset's advantage estimator, policy loss and aggregation on one minibatch."""
    lo = C.from_preset(name).loss
    adv = make_advantage_fn(lo.advantage, lo.std, lo.std_eps)(rewards).flatten()
    per_tok, _ = POLICY_LOSSES[lo.policy_loss](logp, old, adv, mask, lo.clip_eps_low, lo.clip_eps_high, lo.dual_clip)
    agg = AGGREGATIONS[lo.loss_agg]
    return agg.aggregate(per_tok, mask, agg.normalizer(mask)), adv


LOGP = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0], [-2.0, 0.0, 0.0], [-1.0, -1.0, -4.0]])
MASK = torch.tensor([[True, True, True], [True, True, False], [True, False, False], [True, True, True]])


def test_grpo_no_is_is_the_length_normalized_weighted_log_likelihood():
    """L = -(1/N) Σ_i A_i · (1/|o_i|) Σ_t log π(o_i,t): each completion's mean token log-prob (SimPO's
    implicit reward, β aside) weighted by its group-normalized reward; no ratio, so π_old is not read."""
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0]])  # group 0: A = ±1/√2 (sample std √½); group 1: equal -> 0
    logp = LOGP.clone().requires_grad_()
    loss, adv = _preset_loss("grpo_no_is", logp, LOGP + 5.0, rewards, MASK)
    a = 2 ** -0.5
    # tolerance: the advantage divides by std + loss.std_eps (1e-6), not the std itself
    torch.testing.assert_close(adv, torch.tensor([a, -a, 0.0, 0.0]), atol=1e-5, rtol=1e-5)
    # row means: -2, -0.5 (two tokens), -2 (one token), -2; only group 0 has advantages
    torch.testing.assert_close(loss, torch.tensor(-(a * -2.0 + -a * -0.5) / 4), atol=1e-5, rtol=1e-5)
    loss.backward()
    # ∂L/∂logp_it = -A_i / (N · |o_i|): a longer completion gets less per token, padding none
    want = torch.tensor([[-a / 12] * 3, [a / 8, a / 8, 0.0], [0.0, 0.0, 0.0], [0.0] * 3])
    torch.testing.assert_close(logp.grad, want, atol=1e-5, rtol=1e-5)
    cfg = C.from_preset("grpo_no_is")
    assert cfg.loss.policy_loss in RATIO_FREE and not cfg.needs_reference
    assert cfg.optimizer_steps_per_step == C.from_preset("grpo_no_kl").optimizer_steps_per_step == 2
    assert cfg.off_policy_steps == 1  # what dropping the ratio means: the second minibatch is uncorrected


def test_sft_o1_has_no_negative_gradient_and_more_steps_per_sample():
    rewards = torch.tensor([[1.0, -1.0], [-1.0, 0.5]])
    logp = LOGP.clone().requires_grad_()
    loss, adv = _preset_loss("sft_o1", logp, LOGP.detach(), rewards, MASK)
    torch.testing.assert_close(adv, torch.tensor([1.0, 0.0, 0.0, 0.5]))  # ReLU(r): wrong answers dropped
    loss.backward()
    assert (logp.grad <= 0).all()  # every gradient step raises log π (descent on -log π): none pushes down
    assert (logp.grad[1:3] == 0).all()
    o1, sft = C.from_preset("sft_o1"), C.from_preset("onpolicy_sft")
    assert o1.train.steps * o1.sequences_per_step == sft.train.steps * sft.sequences_per_step  # same samples
    assert o1.train.steps == 2 * sft.train.steps and o1.optimizer_steps_per_step == 1 and o1.off_policy_steps == 0
