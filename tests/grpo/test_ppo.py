"""The ppo preset (loss.advantage=gae: a value head on the policy's trunk) through the GRPO loop on
the tiny model: it trains, Phase A's V_old sits where Phase B reads V, the value loss falls on a
fixed batch, the update does not depend on the microbatch size, resume is exact, and the
settings it cannot run with are refused naming the field."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpolab import config as C
from grpolab.algo.value import masked_whiten
from grpolab.data.arith import ArithTask
from grpolab.data.stream import ArithStream
from grpolab.models.tiny import build_char_tokenizer, build_tiny_model
from grpolab.models.value_head import captured_hidden, completion_values
from grpolab.grpo import loop as grpo
from grpolab.grpo.critic import ValueLoss
from grpolab.grpo.objective import SkipEmptyRows
from grpolab.grpo.setup import build_setup

TINY = ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=5", "train.steps=2",
        "train.minibatch_size=8", "train.microbatch_size=4", "train.epochs=2", "train.lr=1e-3",
        "data.eval_prompts=8", "run.tensorboard=false", "run.progress=false",
        "model.dtype=float32"]  # exactness and invariance are float32 checks (auto picks bf16 on CPUs with native bf16)
VALUE_KEYS = ("value/loss", "value/clip_frac", "value/mean", "value/explained_var")


def _rewards() -> list[dict]:
    """A reward that differs between almost any two completions (the task's are often all 0 for an
    untrained model), so the returns vary and the value head has something to fit."""
    from grpolab.rewards.base import register_reward, reward_names

    if "t_ppo_char_sum" not in reward_names():
        register_reward("t_ppo_char_sum")(lambda: lambda prompts, completions, metadata:
                                          [sum(map(ord, c)) % 7 / 7 for c in completions])
    return [{"name": "t_ppo_char_sum", "weight": 1.0}]


def _cfg(*ov: str) -> C.Config:
    return C.from_preset("ppo", TINY + list(ov)).replace(rewards=_rewards())


def _setup(cfg: C.Config):
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, seed=0)
    return build_setup(cfg, policy=model, tokenizer=tok, prompts=ArithStream(ArithTask(ops="+*"), seed=0))


@pytest.mark.parametrize("ov", [[], ["loss.filter_zero_std_groups=true"]])  # the latter: under SkipEmptyRows
def test_ppo_preset_trains_and_reports_the_value_metrics(monkeypatch, ov):
    s = _setup(_cfg(*ov))
    wrapped = s.optim.objective.objective if isinstance(s.optim.objective, SkipEmptyRows) else s.optim.objective
    assert isinstance(wrapped, ValueLoss) and s.models.critic is not None and s.models.reference is not None  # KL in the reward
    head = {k: v.clone() for k, v in s.models.critic.head.state_dict().items()}
    policy = {k: v.clone() for k, v in s.models.policy.state_dict().items()}
    seen, real_learn = [], grpo.learn
    monkeypatch.setattr(grpo, "learn", lambda setup, ro, st: seen.append(ro) or real_learn(setup, ro, st))
    rows = grpo.train(s)
    assert len(rows) == 2
    for row in rows:
        assert all(k in row for k in VALUE_KEYS) and math.isfinite(row["value/loss"]), row
    for ro in seen:
        m = ro.loss_mask
        assert ro.token_advantages.shape == ro.values.shape == ro.returns.shape == m.shape
        a = ro.token_advantages[m].double()
        assert abs(float(a.mean())) < 1e-5 and abs(float(a.var()) - 1.0) < 1e-4  # whitened over the batch
        assert (ro.token_advantages[~m] == 0).all() and (ro.returns[~m] == 0).all()
        torch.testing.assert_close(ro.advantages, ro.token_advantages.sum(-1) / m.sum(-1).clamp(min=1))
    assert any(not torch.equal(head[k], v) for k, v in s.models.critic.head.state_dict().items())  # the head learned
    assert any(not torch.equal(policy[k], v) for k, v in s.models.policy.state_dict().items())
    assert rows[-1]["value/mean"] != 0.0  # step 1's V_old came from the head step 0 trained


def test_phase_a_values_are_the_ones_phase_b_reads():
    """V_old (the trunk alone, Phase A) equals V from the policy's training forward (the hook, Phase
    B) at every counted token before any update: the positions line up."""
    s = _setup(_cfg("train.steps=1"))
    torch.nn.init.normal_(s.models.critic.head.linear.weight, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ro = s.data.engine.generate([it.prompt for it in s.data.prompts.next_batch(4)], 4, generator=s.data.sample_gen)
        ro = s.models.critic.record_values(ro)
        assert ro.values[ro.loss_mask].abs().min() > 0  # not the zero-initialised head
        for idx in s.optim.forward.chunks(ro, 3):  # other chunks than Phase A's: other paddings
            rows = ro.select(idx)
            with captured_hidden(s.models.critic.decoder) as hidden:
                s.optim.forward(s.models.train_model, rows)
            v = completion_values(s.models.critic.head, hidden[0], rows.prompt_len)
            torch.testing.assert_close(v[rows.loss_mask], rows.values[rows.loss_mask], atol=1e-5, rtol=1e-5)


def test_value_loss_falls_on_a_fixed_batch(monkeypatch):
    s = _setup(_cfg("train.steps=1", "loss.value_clip=null", "train.lr=1e-2"))
    losses, real_learn = [], grpo.learn

    def learn(setup, ro, st):
        for _ in range(12):  # the same rollout, again and again
            real_learn(setup, ro, st)
            losses.append(setup.models.critic.step_metrics(ro)["value/loss"])

    monkeypatch.setattr(grpo, "learn", learn)
    grpo.train(s)
    assert losses[0] > 0 and losses[-1] < 0.5 * losses[0], losses


def test_microbatch_size_does_not_change_the_ppo_update():
    """One step with microbatches of 8 and of 1: the same policy and value head (fp64)."""
    results = []
    for micro in (8, 1):
        s = _setup(_cfg("train.steps=1", "train.epochs=1", f"train.microbatch_size={micro}", "train.max_grad_norm=0"))
        s.models.policy.double()
        s.models.critic.head.double()
        s.models.reference().__enter__().double()
        grpo.train(s)
        results.append({**s.models.policy.state_dict(), **{f"head.{k}": v for k, v in s.models.critic.head.state_dict().items()}})
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in results[0].items() if k.startswith("head."))
    for k in results[0]:
        torch.testing.assert_close(results[1][k], results[0][k])


def test_resume_from_a_checkpoint_is_exact(tmp_path):
    from grpolab.grpo.run import train_in_run_dir

    cfg = _cfg("train.steps=3", "run.checkpoint_every=1", "model.hidden_size=32", "model.num_layers=2",
               "model.num_heads=2")
    ref, run = tmp_path / "ref", tmp_path / "run"
    s_ref = build_setup(cfg)
    assert train_in_run_dir(s_ref, ref) == 0
    assert (ref / "checkpoints" / "step-2" / "value_head.safetensors").is_file()
    shutil.copytree(ref, run)
    s = build_setup(cfg)
    assert train_in_run_dir(s, run, resume_from=run / "checkpoints" / "step-2") == 0 and s.start_step == 2

    def rows(d: Path) -> list[dict]:
        lines = (d / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if not k.startswith(("time/", "tokens_per_s/", "mfu"))}
                for x in lines]

    assert len(rows(run)) == 3 and rows(run) == rows(ref)
    assert all(k in rows(run)[2] for k in VALUE_KEYS)
    for k, v in s_ref.models.critic.head.state_dict().items():
        assert torch.equal(v, s.models.critic.head.state_dict()[k]), k
    final_head = load_file(str(run / "final" / "value_head.safetensors"))  # beside the HF folder of the policy
    for k, v in s.models.critic.head.state_dict().items():
        assert torch.equal(v, final_head[k]), k
    for k, v in s_ref.models.policy.state_dict().items():
        assert torch.equal(v, s.models.policy.state_dict()[k]), k


@pytest.mark.parametrize("ov, message", [
    (["loss.policy_loss=gspo"], "loss.policy_loss='gspo' has one ratio per sequence"),
    (["model.padding_free=true"], "turn model.padding_free off"),
    (["model.shared_prompt=true"], "turn model.shared_prompt off"),
    (["model.compile=true", "model.compile_scope=model"], "turn model.compile_scope=model with model.compile off"),
    (["loss.value_coef=0"], "loss.value_coef=0 leaves it untrained"),
    (["loss.gae_lambda=1.5"], r"loss.gae_lambda=1.5 must be in \[0, 1\]"),
    (["loss.value_clip=0"], "loss.value_clip=0.0 > 0"),
])
def test_settings_ppo_cannot_run_with_are_refused(ov, message):
    with pytest.raises(C.ConfigError, match=message):
        C.from_preset("ppo", ov)


def test_whitening_is_over_the_batch_not_the_row():
    """Sanity of what the loop hands Phase B: one row's advantages alone are not re-centred."""
    adv = torch.tensor([[1.0, 1.0, 0.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    w = masked_whiten(adv, mask)
    assert float(w[0, 0]) == float(w[0, 1]) < 0 < float(w[1, 0])
