"""Train/inference mismatch and truncated importance sampling (algo.losses), on hand-made tensors."""

from __future__ import annotations

import math

import torch

from grpolab.algo.losses import logprob_mismatch, truncated_is_weights


def test_truncated_is_weights_are_the_capped_ratio_of_trainer_to_sampler():
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    sampler = torch.tensor([[-1.0, -1.0, -3.0]])
    w = truncated_is_weights(old, sampler, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, math.exp(-1.0), 2.0]]))  # exp(2.5) capped at 2
    assert not w.requires_grad


def test_truncated_is_weights_carry_no_gradient():
    old = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    w = truncated_is_weights(old, torch.tensor([[-1.5, -1.0]]), cap=5.0)
    assert w.grad_fn is None


def test_mismatch_sums_and_maxes_only_counted_tokens():
    train = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -9.0]])
    sampler = torch.tensor([[-1.5, -2.0, 0.0], [-0.9, -1.2, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])  # the large gaps are not counted
    total, top = logprob_mismatch(train, sampler, mask)
    torch.testing.assert_close(total, torch.tensor(0.5 + 0.0 + 0.1 + 0.2))
    torch.testing.assert_close(top, torch.tensor(0.5))


def test_the_objective_weights_each_tokens_policy_loss_by_the_truncated_ratio():
    """loss.tis_cap: the same microbatch's loss with the sampler's log-probs equal to π_old (weights 1)
    and half a nat below it on every token (weights e^0.5 ≈ 1.65, under the cap 2): the loss scales by
    exactly e^0.5; with the cap at 1.2 by 1.2."""
    from grpolab import config as C
    from grpolab.forward import LogProbForward
    from grpolab.models.tiny import build_char_tokenizer, build_tiny_model
    from grpolab.rollout.hf import HFEngine
    from grpolab.grpo.objective import build_objective

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    ro = HFEngine(tok, max_new_tokens=4, model=model).generate(["1+2=", "30+4="], 2,
                                                              generator=torch.Generator().manual_seed(0))
    fwd = LogProbForward.from_config(C.from_preset("grpo", []), None)
    with torch.no_grad():
        old = fwd.rollout_logprobs(model, ro)
    ro = ro.replace(old_logp=old, advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]), ref_logp=old)

    def loss(cap: float, shift: float) -> torch.Tensor:
        cfg = C.from_preset("grpo", [f"loss.tis_cap={cap}", "loss.kl_coef=0"])
        obj = build_objective(cfg.loss, cfg.rollout, fwd)
        micro = ro.replace(sampler_logp=(old - shift) * ro.loss_mask)
        value, stats = obj(model, micro, obj.normalizer(micro.loss_mask))
        return value.detach()

    base = loss(0.0, 0.0)
    torch.testing.assert_close(loss(2.0, 0.0), base)
    torch.testing.assert_close(loss(2.0, 0.5), base * math.exp(0.5))
    torch.testing.assert_close(loss(1.2, 0.5), base * 1.2)
    torch.testing.assert_close(loss(0.0, 0.5), base)  # off
