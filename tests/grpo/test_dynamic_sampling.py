"""DAPO dynamic sampling (grpo/dynamic_sampling.py): the kept batch has exactly prompts_per_step
groups, none of equal rewards; extra batches and dropped groups are counted; the cap fills the
batch; ranks draw in lockstep; a resumed run is exact. Also the loss masks DAPO relies on: a
truncated completion (loss.mask_truncated) and a zero-std group (loss.filter_zero_std_groups)
contribute no gradient."""

from __future__ import annotations

import json
import shutil
import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from grpolab import config as C
from grpolab.algo.advantages import zero_std_groups
from grpolab.data.arith import ArithTask, PromptItem
from grpolab.data.stream import ArithStream, ListStream
from grpolab.parallel.parallel import Parallel
from grpolab.models.tiny import build_char_tokenizer, build_tiny_model
from grpolab.rewards.registry import build_reward
from grpolab.batch import Rollout
from grpolab.grpo import loop as grpo
from grpolab.batch import concat_rollouts
from grpolab.grpo.dynamic_sampling import draw_batch, pick_groups
from grpolab.grpo.objective import build_objective
from grpolab.grpo.setup import build_setup
from grpolab.grpo.stats import StepStats

G, LC = 4, 3  # group size, completion width of the fake engine


# ----------------------------------------------------------------------------- a fake Phase A
class FakeEngine:
    """Completions without a model: each call's prompts are left-padded to a width of its own (so
    batches differ in prompt_len); row j of a group gets tokens [j+1, j+2, EOS]."""

    def __init__(self):
        self.calls = 0
        self.weight_version = 0

    def generate(self, prompts, group_size, *, generator=None, greedy=False) -> Rollout:
        self.calls += 1
        n, lp = len(prompts) * group_size, 2 + self.calls % 3
        comp = torch.stack([torch.tensor([j % group_size + 1, j % group_size + 2, 9]) for j in range(n)])
        ids = torch.cat([torch.full((n, lp), 7), comp], 1)
        am = torch.ones(n, lp + LC, dtype=torch.bool)
        am[:, 0] = False  # one column of left padding
        return Rollout(input_ids=ids, attention_mask=am, prompt_len=lp, loss_mask=torch.ones(n, LC, dtype=torch.bool),
                       truncated=torch.zeros(n, dtype=torch.bool), group_size=group_size,
                       sampler_logp=-torch.rand(n, LC, generator=generator))

    def decode(self, ro):
        return [str(i % ro.group_size) for i in range(ro.num_sequences)]


def _signal_reward(prompts, completions, metadata):
    """Unequal rewards within the group of a prompt whose meta says `signal`, all 0 otherwise."""
    return [float(m["signal"]) * int(c) for c, m in zip(completions, metadata)]


def _fake_setup(signals: list[bool], P: int, cap: int, parallel: Parallel | None = None) -> SimpleNamespace:
    """A Setup-like namespace whose prompt stream yields prompts i = 0, 1, ... with signal[i]."""
    cfg = C.from_preset("dapo", [f"rollout.prompts_per_step={P}", f"rollout.group_size={G}",
                                 f"rollout.max_new_tokens={LC}", f"rollout.max_generation_batches={cap}",
                                 f"train.minibatch_size={P * G}", f"train.microbatch_size={P * G}"])
    items = [PromptItem(f"p{i}", {"signal": sig, "i": i}) for i, sig in enumerate(signals)]
    stream = ListStream(items, seed=0)
    stream._order = list(range(len(items)))  # in order, so the test knows which prompt comes when
    data = SimpleNamespace(prompts=stream, engine=FakeEngine(), rewards=[(_named(_signal_reward), 1.0)],
                           sample_gen=torch.Generator().manual_seed(0), reward_pool=None, prefetch=None, agent=None)
    services = SimpleNamespace(parallel=parallel or Parallel(), progress=SimpleNamespace(phase=lambda *a: None))
    return SimpleNamespace(cfg=cfg, data=data, services=services, on_reward_error="raise",
                           models=SimpleNamespace(tokenizer=SimpleNamespace(pad_token_id=0)))


def _named(fn):
    fn.name = "signal"
    return fn


def _ids(batch) -> list[int]:
    return [it.meta["i"] for it in batch.items]


def test_a_filtered_batch_has_exactly_p_groups_none_of_equal_rewards():
    # batches of 4 prompts: 1 + 2 + 0 signals, then the 4th batch has 3 (one more than needed)
    signals = [True, False, False, False, False, True, True, False, False, False, False, False,
               False, True, True, True] + [False] * 8
    s = _fake_setup(signals, P=4, cap=0)
    st = StepStats(0)
    b = draw_batch(s, st)
    assert _ids(b) == [0, 5, 6, 13]  # the first 4 groups with a signal, in draw order; 14, 15 cut off
    assert not zero_std_groups(b.rewards.view(-1, G)).any()
    assert b.rollout.num_sequences == 4 * G and len(b.texts) == 4 * G and b.scores["signal"].shape == (4 * G,)
    assert (st.gen_batches, st.dropped_groups, s.data.engine.calls) == (4, 10, 4)
    assert s.data.prompts.pos == 16 and st.notes == []


def test_rows_stay_consistent_across_batches_of_different_prompt_widths():
    s = _fake_setup([True, False, True, True, False, True] + [False] * 6, P=2, cap=0)
    b = draw_batch(s, StepStats(0))
    assert _ids(b) == [0, 2]
    ro = b.rollout
    # the batches' prompts are 2 and 3 real tokens wide (3 and 4 columns, one of them all padding,
    # which `Rollout.select` trims); the narrower is left-padded with the pad id to the wider
    assert ro.prompt_len == 3
    assert ro.attention_mask[:, : ro.prompt_len].sum(-1).tolist() == [2] * G + [3] * G
    assert bool((ro.input_ids[~ro.attention_mask] == 0).all()) and bool((ro.input_ids[ro.attention_mask][:1] == 7).all())
    assert torch.equal(ro.completion_ids, torch.tensor([[j % G + 1, j % G + 2, 9] for j in range(2 * G)]))
    assert b.rewards.tolist() == b.scores["signal"].tolist() == [float(j % G) for j in range(2 * G)]


def test_the_cap_fills_the_batch_with_the_earliest_dropped_groups_and_says_so():
    s = _fake_setup([False, True, False, False] + [False] * 20, P=4, cap=3)
    st = StepStats(0)
    b = draw_batch(s, st)
    assert st.gen_batches == 3 == s.data.engine.calls and s.data.prompts.pos == 12  # stopped at the cap
    assert sorted(_ids(b)) == [0, 1, 2, 3]  # the signal group and the 3 earliest without one
    assert zero_std_groups(b.rewards.view(-1, G)).tolist() == [True, False, True, True]
    assert st.dropped_groups == 12 - 4  # generated groups of equal rewards, minus the 3 that fill
    assert len(st.notes) == 1 and "rollout.max_generation_batches=3" in st.notes[0] and "1 of 4" in st.notes[0]


def test_no_cap_keeps_generating_and_one_batch_without_dynamic_sampling():
    signals = [False] * 4 * 6 + [True] * 4
    s = _fake_setup(signals, P=4, cap=0)
    st = StepStats(0)
    assert _ids(draw_batch(s, st)) == [24, 25, 26, 27] and st.gen_batches == 7
    s = _fake_setup(signals, P=4, cap=0)
    s.cfg = s.cfg.replace(**{"rollout.dynamic_sampling": False})
    st = StepStats(0)
    assert _ids(draw_batch(s, st)) == [0, 1, 2, 3] and st.gen_batches is None and s.data.engine.calls == 1


def test_pick_groups_prefers_signal_in_draw_order_then_fills():
    sig = [torch.tensor([False, True]), torch.tensor([True, True])]
    assert pick_groups(sig, 2) == [(0, 1), (1, 0)]
    assert pick_groups(sig, 4) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with pytest.raises(ValueError, match="4 groups generated, 5 wanted"):
        pick_groups(sig, 5)


# ----------------------------------------------------------------------------- ranks in lockstep
@dataclass
class _Hub:
    barrier: threading.Barrier
    flags: list


@dataclass(frozen=True)
class ThreadRank(Parallel):
    """A rank of a world simulated by threads: `any` is a real collective over them (a barrier)."""

    hub: Any = None

    def any(self, flag: bool) -> bool:
        self.hub.flags[self.rank] = bool(flag)
        self.hub.barrier.wait()
        out = any(self.hub.flags)
        self.hub.barrier.wait()
        return out


def test_two_ranks_draw_in_lockstep_and_each_fills_its_own_share():
    # P = 4: rank 0 keeps prompts 4b, 4b+1 of batch b, rank 1 prompts 4b+2, 4b+3
    signals = [True, True, False, False,  # rank 0 full after batch 0; rank 1 has nothing
               False, False, True, False,  # rank 1: 1 of 2
               True, False, False, True] + [False] * 8  # rank 1: full (prompt 11)
    hub = _Hub(threading.Barrier(2, timeout=30), [False, False])
    setups = [_fake_setup(signals, P=4, cap=0, parallel=ThreadRank(rank=r, world_size=2, hub=hub)) for r in (0, 1)]
    out: dict[int, tuple] = {}

    def run(r):
        st = StepStats(0)
        out[r] = (draw_batch(setups[r], st), st)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    (b0, st0), (b1, st1) = out[0], out[1]
    assert _ids(b0) == [0, 1] and _ids(b1) == [6, 11]
    assert st0.gen_batches == st1.gen_batches == 3  # every rank drew every batch ...
    assert setups[0].data.prompts.state_dict() == setups[1].data.prompts.state_dict() == {"epoch": 0, "pos": 12}
    assert (setups[0].data.engine.calls, setups[1].data.engine.calls) == (1, 3)  # ... but a full rank generated no more
    assert (st0.dropped_groups, st1.dropped_groups) == (0, 4)  # summed over ranks by StepStats.reduce


def test_concat_rollouts_pads_prompts_left_and_completions_right():
    def ro(lp, lc, n, fill):
        return Rollout(input_ids=torch.full((n, lp + lc), fill), attention_mask=torch.ones(n, lp + lc, dtype=torch.bool),
                       prompt_len=lp, loss_mask=torch.ones(n, lc, dtype=torch.bool),
                       truncated=torch.tensor([fill == 1] * n), group_size=2, old_logp=torch.full((n, lc), -1.0 * fill))

    out = concat_rollouts([ro(2, 3, 2, 1), ro(4, 1, 2, 2)], pad=0)
    assert out.prompt_len == 4 and out.loss_mask.shape == (4, 3)
    assert out.input_ids.tolist() == [[0, 0, 1, 1, 1, 1, 1]] * 2 + [[2, 2, 2, 2, 2, 0, 0]] * 2
    assert out.attention_mask.sum(-1).tolist() == [5, 5, 5, 5]
    assert out.loss_mask.sum(-1).tolist() == [3, 3, 1, 1] and out.truncated.tolist() == [True, True, False, False]
    assert out.old_logp.tolist() == [[-1.0] * 3] * 2 + [[-2.0, 0.0, 0.0]] * 2 and out.ref_logp is None
    with pytest.raises(ValueError, match="group sizes"):
        concat_rollouts([ro(2, 3, 2, 1), ro(2, 3, 2, 1).replace(group_size=1)], pad=0)


# ----------------------------------------------------------------------------- the real loop
def _tiny_setup(cfg, seed=0):
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, seed=seed)
    return build_setup(cfg, policy=model, tokenizer=tok, prompts=ArithStream(ArithTask(ops="+*"), seed=seed))


LOOP = ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=5", "rollout.temperature=1.5",
        "train.minibatch_size=8", "train.microbatch_size=4", "train.lr=1e-2", "run.tensorboard=false",
        "run.progress=false"]


def test_the_loop_trains_on_p_groups_of_unequal_rewards(monkeypatch):
    s = _tiny_setup(C.from_preset("dapo", LOOP + ["train.steps=3", "rollout.max_generation_batches=0"]))
    seen, drawn = [], []
    real_learn, real_next = grpo.learn, s.data.prompts.next_batch
    monkeypatch.setattr(grpo, "learn", lambda setup, ro, st: seen.append(ro) or real_learn(setup, ro, st))
    monkeypatch.setattr(s.data.prompts, "next_batch", lambda n: drawn.append(n) or real_next(n))
    rows = grpo.train(s)
    for ro in seen:
        assert ro.num_sequences == 4 * 4
        assert not zero_std_groups(ro.rewards.view(-1, 4)).any()
    assert sum(r["rollout/gen_batches"] for r in rows) == len(drawn) > 3  # some steps needed more batches
    assert all(r["groups/zero_std_frac"] == 0.0 for r in rows)
    assert all(r["rollout/dropped_groups"] >= 4 * (r["rollout/gen_batches"] - 1) - 3 for r in rows)


def test_zero_std_groups_get_no_loss_in_the_loop(monkeypatch):
    """loss.filter_zero_std_groups without dynamic sampling: the rows of groups with equal rewards
    reach Phase B with an empty loss mask, the others keep theirs."""
    from grpolab.rewards.registry import register_reward, reward_names

    if "t_plus_len" not in reward_names():  # unequal within most '+' groups, all 0 on '*' prompts
        register_reward("t_plus_len")(lambda: lambda prompts, completions, metadata:
                                      [float(len(c)) if "+" in p else 0.0 for p, c in zip(prompts, completions)])
    cfg = C.from_preset("grpo", LOOP + ["train.steps=2", "loss.filter_zero_std_groups=true", "loss.kl_coef=0"])
    s = _tiny_setup(cfg.replace(rewards=[{"name": "t_plus_len"}]))
    seen = []
    real_learn = grpo.learn
    monkeypatch.setattr(grpo, "learn", lambda setup, ro, st: seen.append(ro) or real_learn(setup, ro, st))
    grpo.train(s)
    flat = torch.cat([zero_std_groups(ro.rewards.view(-1, 4)).repeat_interleave(4) for ro in seen])
    counted = torch.cat([ro.loss_mask.any(-1) for ro in seen])
    assert flat.any() and (~flat).any()  # both kinds of group occurred
    assert not counted[flat].any() and counted[~flat].all()


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_a_masked_truncated_completion_contributes_no_gradient(agg):
    """A real backward through the objective: with loss.mask_truncated the rollout's gradient equals
    the gradient of the rollout without the truncated row; without the mask it does not."""
    cfg = C.from_preset("dapo", LOOP + [f"loss.loss_agg={agg}", "loss.mask_truncated=true"])
    s = _tiny_setup(cfg)
    g = torch.Generator().manual_seed(0)
    ro = s.data.engine.generate(["12+3=", "4*5="], 4, generator=g)
    ro = ro.replace(truncated=torch.arange(8) == 5, advantages=torch.randn(8, generator=g))
    objective = build_objective(cfg.loss, cfg.rollout, s.optim.forward)  # not SkipEmptyRows: row 5 is forwarded

    def grads(r):
        s.models.policy.zero_grad(set_to_none=True)
        loss, _ = objective(s.models.train_model, r, objective.normalizer(r.loss_mask))
        loss.backward()
        return [p.grad.clone() for p in s.models.policy.parameters()]

    mask = s.train_mask(ro, torch.arange(8.0))  # unequal rewards: no group is filtered
    assert not mask[5].any() and all(mask[i].any() for i in range(8) if i != 5)
    masked = grads(ro.replace(loss_mask=mask))
    without = grads(ro.select(torch.tensor([0, 1, 2, 3, 4, 6, 7])))
    unmasked = grads(ro)
    for a, b in zip(masked, without):
        torch.testing.assert_close(a, b)
    assert any(not torch.allclose(a, b) for a, b in zip(unmasked, without))


def test_a_resumed_run_with_dynamic_sampling_is_exact(tmp_path):
    from grpolab.grpo.run import train_in_run_dir

    cfg = C.from_preset("dapo", LOOP + ["train.steps=3", "run.checkpoint_every=1", "rollout.max_generation_batches=0"])
    ref = tmp_path / "ref"
    assert train_in_run_dir(_tiny_setup(cfg), ref) == 0
    rows = [json.loads(x) for x in (ref / "metrics.jsonl").read_text().splitlines()]
    assert rows[2]["rollout/gen_batches"] > 1  # the resumed step draws extra batches
    run = tmp_path / "run"
    shutil.copytree(ref, run)
    s = _tiny_setup(cfg)
    assert train_in_run_dir(s, run, resume_from=run / "checkpoints" / "step-2") == 0
    assert s.start_step == 2

    def strip(path):
        return [{k: v for k, v in json.loads(x).items() if not k.startswith(("time/", "tokens_per_s/", "mfu"))}
                for x in path.read_text().splitlines()]

    assert strip(run / "metrics.jsonl") == strip(ref / "metrics.jsonl")
    assert (run / "samples.jsonl").read_text() == (ref / "samples.jsonl").read_text()


def test_the_overlong_reward_reads_the_loop_lengths(monkeypatch):
    """In the loop, the overlong reward gets each completion's generated tokens and max_new_tokens."""
    cfg = C.from_preset("grpo", LOOP + ["train.steps=1", "rollout.temperature=3.0"]).replace(
        rewards=[{"name": "exact_match"}, {"name": "overlong", "kwargs": {"buffer_len": 2}}])
    s = _tiny_setup(cfg)
    seen = []
    real_learn = grpo.learn
    monkeypatch.setattr(grpo, "learn", lambda setup, ro, st: seen.append(ro) or real_learn(setup, ro, st))
    rows = grpo.train(s)
    fn = build_reward("overlong", buffer_len=2)
    lengths = seen[0].attention_mask[:, seen[0].prompt_len:].sum(-1)
    want = fn([""] * 16, [""] * 16, [{"completion_tokens": int(n), "max_new_tokens": 5} for n in lengths])
    assert rows[0]["reward/overlong/mean"] == pytest.approx(sum(want) / 16)
    assert min(want) == -1.0  # some completion was truncated at 5 tokens
