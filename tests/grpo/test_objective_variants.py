"""The issue-43 variants wired into the objective and the loop: CISPO's and SAPO's options reach
the loss, KL in the reward (verl's use_kl_in_reward) replaces the loss term and is read in Phase A
before the advantages, loss.std=batch reduces over the ranks, normalize-then-sum shapes the
advantages, bnpo under SkipEmptyRows, and each new registry entry trains."""

from __future__ import annotations

import pytest
import torch

from grpolab import config as C
from grpolab.algo.advantages import batch_normalize
from grpolab.data.arith import ArithTask
from grpolab.data.stream import ArithStream
from grpolab.parallel.parallel import Parallel
from grpolab.models.tiny import build_char_tokenizer, build_tiny_model
from grpolab.rewards.base import combine
from grpolab.grpo import loop as grpo
from grpolab.grpo.objective import SkipEmptyRows
from grpolab.grpo.setup import build_setup


def _rewards(*names: str) -> list[dict]:
    """Rewards that differ between almost any two completions (an untrained model's task rewards
    are often all 0): the character sum and the length, modulo small numbers."""
    from grpolab.rewards.base import register_reward, reward_names

    fns = {"t43_char_sum": lambda c: sum(map(ord, c)) % 7 / 7, "t43_length": lambda c: 10.0 * (len(c) % 3)}
    for name in names:
        if name not in reward_names():
            register_reward(name)(lambda f=fns[name]: lambda prompts, completions, metadata: [f(c) for c in completions])
    return [{"name": n, "weight": 1.0} for n in names]


def _cfg(*ov: str) -> C.Config:
    base = ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=5", "train.steps=1",
            "train.minibatch_size=16", "train.microbatch_size=8", "train.epochs=1", "train.lr=1e-3",
            "data.eval_prompts=8", "run.tensorboard=false", "run.progress=false", "model.dtype=float32"]  # exactness and invariance are float32 checks (auto picks bf16 on CPUs with native bf16)
    return C.from_preset("grpo", base + list(ov)).replace(rewards=_rewards("t43_char_sum"))


def _setup(cfg: C.Config):
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, seed=0)
    return build_setup(cfg, policy=model, tokenizer=tok, prompts=ArithStream(ArithTask(ops="+*"), seed=0))


def _capture(monkeypatch, s) -> dict:
    """Records what the loop hands the advantage function and Phase B."""
    seen: dict = {}
    real_adv, real_learn = s.optim.advantage_fn, grpo.learn

    def advantage_fn(rewards, reduce):
        seen["adv_in"] = rewards.clone()
        return real_adv(rewards, reduce)

    def learn(setup, ro, st):
        seen["ro"] = ro
        real_learn(setup, ro, st)

    s.optim.advantage_fn = advantage_fn
    monkeypatch.setattr(grpo, "learn", learn)
    return seen


# ----------------------------------------------------------------------------- the objective
@pytest.mark.parametrize("loss, keywords", [
    ("cispo", {"cispo_ratio_max": 2.5}),
    ("sapo", {"sapo_temperature_pos": 0.5, "sapo_temperature_neg": 2.0}),
    ("clipped", {}),
])
def test_policy_loss_options_are_bound_from_the_config(loss, keywords):
    cfg = _cfg(f"loss.policy_loss={loss}", "loss.cispo_ratio_max=2.5", "loss.sapo_temperature_pos=0.5",
               "loss.sapo_temperature_neg=2.0")
    objective = _setup(cfg).optim.objective
    assert objective.policy_loss.keywords == keywords


def _rollout(s, n_prompts=4):
    items = s.data.prompts.next_batch(n_prompts)
    ro = s.data.engine.generate([it.prompt for it in items], s.cfg.rollout.group_size,
                           generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    return ro.replace(advantages=torch.randn(ro.num_sequences, generator=g),
                      ref_logp=-torch.rand(ro.loss_mask.shape, generator=g) * ro.loss_mask)


def test_kl_in_reward_takes_the_kl_term_out_of_the_loss_but_still_measures_it():
    losses, kls = {}, {}
    for name, ov in (("in_loss", []), ("in_reward", ["loss.kl_in_reward=true"]), ("none", ["loss.kl_coef=0"])):
        s = _setup(_cfg("loss.kl_coef=0.5", *ov))
        ro = _rollout(s)
        loss, stats = s.optim.objective(s.models.policy, ro, s.optim.objective.normalizer(ro.loss_mask))
        losses[name], kls[name] = loss.detach(), stats["kl"]
    assert _setup(_cfg("loss.kl_coef=0.5", "loss.kl_in_reward=true")).optim.objective.kl_coef == 0.0
    torch.testing.assert_close(losses["in_reward"], losses["none"])  # no KL term in the loss
    assert not torch.allclose(losses["in_loss"], losses["none"])
    torch.testing.assert_close(kls["in_reward"], kls["in_loss"])  # the same KL, reported
    assert kls["in_reward"] > 0 and kls["none"] == 0


def test_bnpo_skipping_empty_rows_keeps_the_loss_and_the_gradient():
    cfg = _cfg("loss.loss_agg=bnpo", "loss.mask_truncated=true", "loss.kl_coef=0")
    s = _setup(cfg)
    s.models.policy.double()
    assert isinstance(s.optim.objective, SkipEmptyRows)
    ro = _rollout(s)
    mask = ro.loss_mask.clone()
    mask[[1, 5, 6]] = False  # three masked completions
    ro = ro.replace(loss_mask=mask)
    norm = s.optim.objective.normalizer(mask)
    out = []
    for obj in (s.optim.objective.objective, s.optim.objective):
        s.models.policy.zero_grad()
        total = sum(obj(s.models.policy, ro.select(torch.arange(k, k + 8)), norm)[0] for k in (0, 8))
        total.backward()
        out.append((total.detach(), [p.grad.clone() for p in s.models.policy.parameters()]))
    torch.testing.assert_close(out[1][0], out[0][0])
    for a, b in zip(out[0][1], out[1][1]):
        torch.testing.assert_close(b, a)


# ----------------------------------------------------------------------------- the loop
def test_kl_in_reward_reads_old_and_ref_logprobs_before_the_advantages(monkeypatch):
    beta = 0.5
    cfg = _cfg("loss.kl_coef=0.5", "loss.kl_in_reward=true", "loss.kl_estimator=k3")
    assert cfg.minibatches_per_epoch == 1 and cfg.needs_old_logp_pass  # one minibatch, but the KL reads π_old
    s = _setup(cfg)
    with torch.no_grad():  # a reference unlike π_old, so the penalty is not ~0
        for p in s.models.reference().__enter__().parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    seen = _capture(monkeypatch, s)
    grpo.train(s)
    ro = seen["ro"]
    assert ro.old_logp is not None and ro.ref_logp is not None  # recorded in Phase A
    d = ro.ref_logp - ro.old_logp
    kl = ((torch.exp(d) - d - 1) * ro.loss_mask).sum(-1)  # k3 of KL(π_old ‖ π_ref), summed per completion
    assert (kl > 1e-3).all()
    torch.testing.assert_close(seen["adv_in"].flatten(), ro.rewards - beta * kl)


def test_batch_std_reduces_its_statistics_over_the_ranks(monkeypatch):
    class Spy(Parallel):
        def all_reduce_sum(self, value):
            calls.append(value.clone())
            return value

    for std in ("batch", "sample"):
        calls: list = []
        s = _setup(_cfg(f"loss.std={std}", "loss.kl_coef=0"))
        s.services.parallel = Spy()
        seen = _capture(monkeypatch, s)
        grpo.train(s)
        stats = [c for c in calls if c.dtype == torch.float64]  # batch_std's count and sum, then Σ squares
        ro = seen["ro"]
        if std == "batch":
            assert len(stats) == 2 and stats[0].tolist() == [16.0, pytest.approx(float(ro.rewards.double().sum()))]
            torch.testing.assert_close(ro.advantages, batch_normalize(ro.rewards.view(-1, 4), 1e-6).flatten())
        else:
            assert not stats  # group statistics: nothing to reduce


def test_normalize_then_sum_shapes_the_advantages_not_the_reported_reward(monkeypatch):
    cfg = _cfg("loss.multi_objective_aggregation=normalize_then_sum", "loss.kl_coef=0")
    cfg = cfg.replace(rewards=_rewards("t43_char_sum", "t43_length"))
    s = _setup(cfg)
    seen = _capture(monkeypatch, s)
    records = []
    s.services.hooks.append(lambda step, row, record: records.append(record))
    grpo.train(s)
    scores, ro = records[0].scores, seen["ro"]
    weights = {"t43_char_sum": 1.0, "t43_length": 1.0}
    torch.testing.assert_close(ro.rewards, combine(scores, weights))  # metrics: the plain weighted sum
    torch.testing.assert_close(seen["adv_in"].flatten(), combine(scores, weights, "normalize_then_sum", 4, 1e-6))
    assert not torch.allclose(seen["adv_in"].flatten(), ro.rewards)


@pytest.mark.parametrize("ov", [
    ["loss.policy_loss=cispo"], ["loss.policy_loss=sapo"], ["loss.loss_agg=token-sum"], ["loss.loss_agg=bnpo"],
    ["loss.kl_estimator=abs"], ["loss.kl_estimator=low_var_kl"], ["loss.std=batch"],
    ["loss.kl_in_reward=true"], ["loss.multi_objective_aggregation=normalize_then_sum"],
])
def test_each_new_option_trains(ov):
    cfg = _cfg("train.minibatch_size=8", "train.microbatch_size=4", "train.epochs=2", *ov)
    s = _setup(cfg)
    before = {k: v.clone() for k, v in s.models.policy.state_dict().items()}
    rows = grpo.train(s)
    assert len(rows) == 1 and s.consecutive_skips == 0  # no step skipped for a non-finite loss or gradient
    assert any(not torch.equal(before[k], v) for k, v in s.models.policy.state_dict().items())


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize("ov, message", [
    (["loss.kl_coef=0", "loss.kl_in_reward=true"], "loss.kl_in_reward=true subtracts"),
    (["loss.cispo_ratio_max=0"], "loss.cispo_ratio_max=0.0 must be > 0"),
    (["loss.sapo_temperature_neg=-1"], "loss.sapo_temperature_neg=-1.0 must be > 0"),
    (["loss.multi_objective_aggregation=sum"], "loss.multi_objective_aggregation='sum' is not one of"),
    (["loss.multi_objective_aggregation=normalize_then_sum", "rollout.group_size=1", "loss.advantage=reinforce",
      "train.minibatch_size=4", "train.microbatch_size=4"], "normalizes each reward within its group"),
])
def test_new_fields_are_validated(ov, message):
    with pytest.raises(C.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        C.from_preset("grpo", ov)
