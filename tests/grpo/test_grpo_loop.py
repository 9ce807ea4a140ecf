"""The GRPO loop on a tiny random model: Phase A/B invariants and microbatch invariance."""


import pytest
from functools import partial
import torch

from grpolab import config as C
from grpolab.data.arith import ArithTask
from grpolab.data.stream import ArithStream
from grpolab.models.tiny import build_char_tokenizer, build_tiny_model
from grpolab.grpo import loop as grpo
from grpolab.grpo.setup import build_setup


def _cfg(*ov):
    base = ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=5",
            "train.steps=2", "train.minibatch_size=8", "train.microbatch_size=8", "train.epochs=2",
            "train.lr=1e-3", "data.eval_prompts=8", "run.tensorboard=false", "run.progress=false",
            "model.dtype=float32"]  # exactness and invariance are float32 checks (auto picks bf16 on CPUs with native bf16)
    return C.from_preset("grpo", base + list(ov))


def _setup(cfg, seed=0):
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, seed=seed)
    stream = ArithStream(ArithTask(ops="+*"), seed=seed)
    return build_setup(cfg, policy=model, tokenizer=tok, prompts=stream)


class _Spy:
    """Wraps the objective: records each microbatch's ratio stats and the rollout tensors seen."""

    def __init__(self, obj):
        self.obj = obj
        self.calls = []

    def normalizer(self, mask):
        return self.obj.normalizer(mask)

    def __call__(self, model, micro, normalizer):
        loss, stats = self.obj(model, micro, normalizer)
        self.calls.append({"ratio_min": float(stats["ratio_min"]), "ratio_max": float(stats["ratio_max"]),
                           "old": None if micro.old_logp is None else micro.old_logp.clone()})
        return loss, stats


def _char_sum_reward():
    """A reward that differs between almost any two completions (so every step has a gradient; the
    task's own rewards are all 0 for some draws of an untrained model)."""
    from grpolab.rewards.base import register_reward, reward_names

    if "t_char_sum" not in reward_names():
        register_reward("t_char_sum")(lambda: lambda prompts, completions, metadata:
                                      [sum(map(ord, c)) % 7 / 7 for c in completions])
    return [{"name": "t_char_sum", "weight": 1.0}]


def test_old_logp_untouched_ratio_one_first_micro_and_params_change(monkeypatch):
    cfg = _cfg().replace(rewards=_char_sum_reward())
    s = _setup(cfg)
    spy = _Spy(s.optim.objective)
    s.optim.objective = spy
    before = {k: v.clone() for k, v in s.models.policy.state_dict().items()}
    seen = {}
    real_learn = grpo.learn

    def learn_spy(setup, ro, st):
        seen.setdefault("ro", []).append((ro, ro.old_logp.clone(), ro.advantages.clone(), ro.input_ids.clone()))
        real_learn(setup, ro, st)

    monkeypatch.setattr(grpo, "learn", learn_spy)
    rows = grpo.train(s)
    assert len(rows) == 2
    for ro, old, adv, ids in seen["ro"]:
        # Phase B read the rollout but never wrote to it
        assert torch.equal(ro.old_logp, old) and torch.equal(ro.advantages, adv) and torch.equal(ro.input_ids, ids)
    # 2 steps × 2 epochs × 2 minibatches × 1 microbatch
    assert len(spy.calls) == 8
    first = spy.calls[0]
    # π_new == π_old before the first optimizer step, up to float rounding: Phase A's π_old chunks and
    # this microbatch group other rows, so their GEMMs have other shapes, and on some CPUs (an AVX512
    # host without AMX: 0.99999976) a row's fp32 result then differs in the last bits. One step at
    # lr 1e-3 moves the ratio far more than 1e-5 (the next assertion).
    assert abs(first["ratio_min"] - 1.0) < 1e-5 and abs(first["ratio_max"] - 1.0) < 1e-5
    moved = max(max(abs(c["ratio_max"] - 1.0), abs(c["ratio_min"] - 1.0)) for c in spy.calls[1:4])
    assert moved > 1e-4  # later minibatches moved
    after = s.models.policy.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_single_minibatch_single_epoch_skips_old_logp_pass():
    cfg = _cfg("train.epochs=1", "train.minibatch_size=16", "train.microbatch_size=16", "train.steps=1")
    assert not cfg.needs_old_logp_pass
    s = _setup(cfg)
    spy = _Spy(s.optim.objective)
    s.optim.objective = spy
    grpo.train(s)
    assert spy.calls[0]["old"] is None  # old = new.detach(): ratio ≡ 1
    assert spy.calls[0]["ratio_min"] == 1.0 == spy.calls[0]["ratio_max"]


def test_one_minibatch_per_epoch_records_old_logp_in_epoch_zero(monkeypatch):
    """μ = 2 with one minibatch: no Phase-A pass; epoch 0 (all rows, before its optimizer step)
    records π_old's log-probs, and the update equals the one with a separate π_old pass."""
    from grpolab.forward import batched_logprobs

    cfg = _cfg("train.minibatch_size=16", "train.microbatch_size=4", "train.steps=1", "train.max_grad_norm=0")
    assert cfg.minibatches_per_epoch == 1 and not cfg.needs_old_logp_pass
    real_learn, results = grpo.learn, []
    for explicit in (False, True):
        s = _setup(cfg)
        s.models.policy.double()  # fp64: the two paths differ only by float rounding
        spy = _Spy(s.optim.objective)
        s.optim.objective = spy

        def learn(setup, ro, st):
            assert ro.old_logp is None  # Phase A skipped the π_old pass
            ref = batched_logprobs(setup.models.policy, ro, cfg.rollout.temperature, 16, None)
            real_learn(setup, ro.replace(old_logp=ref) if explicit else ro, st)

        monkeypatch.setattr(grpo, "learn", learn)
        grpo.train(s)
        if not explicit:
            # 2 epochs × 4 microbatches: epoch 0 has old = None (ratio ≡ 1), epoch 1 reads the recorded old
            assert [c["old"] is None for c in spy.calls] == [True] * 4 + [False] * 4
            assert all(c["ratio_min"] == 1.0 == c["ratio_max"] for c in spy.calls[:4])
        results.append({k: v.clone() for k, v in s.models.policy.state_dict().items()})
    for k in results[0]:
        torch.testing.assert_close(results[0][k], results[1][k])
    assert any(not torch.equal(results[0][k], _setup(cfg).models.policy.state_dict()[k].double()) for k in results[0])


def test_scatter_rows_puts_trimmed_pieces_back():
    from grpolab.batch import scatter_rows

    idx = torch.tensor([2, 0, 3, 1])
    out = scatter_rows([torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[5.0], [6.0]])], idx, (4, 3))
    torch.testing.assert_close(out, torch.tensor([[3.0, 4.0, 0.0], [6.0, 0.0, 0.0], [1.0, 2.0, 0.0], [5.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="3 rows"):
        scatter_rows([torch.zeros(3, 1)], idx, (4, 1))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "constant"])
def test_microbatch_size_does_not_change_the_update(agg):
    """One GRPO step with microbatch 1 and with the whole minibatch give the same weights."""
    results = []
    for micro in (16, 1):
        cfg = _cfg(f"train.microbatch_size={micro}", "train.minibatch_size=16", "train.epochs=1",
                   "train.steps=1", f"loss.loss_agg={agg}", "loss.kl_coef=0.04",
                   "train.max_grad_norm=0")  # clipping is also linear, but keep the check exact
        s = _setup(cfg)
        s.models.policy.double()  # fp64: the sums differ only by float rounding of the accumulation order
        if s.models.reference is not None:
            s.models.reference().__enter__().double()
        grpo.train(s)
        results.append({k: v.clone() for k, v in s.models.policy.state_dict().items()})
    for k in results[0]:
        torch.testing.assert_close(results[1][k], results[0][k])


def test_padding_free_forwards_give_the_same_training(monkeypatch):
    """model.padding_free: Phase A's π_old / π_ref passes and Phase B's microbatches forward only
    real tokens; in fp64 two steps (μ = 2, KL, 2 minibatches) end at the same weights."""
    import dataclasses

    from grpolab.forward import LAYOUTS, LogProbForward

    results, calls, packed = [], [], []
    real_pass = LogProbForward.rollout_logprobs

    def spy(fwd, model, ro):
        calls.append(fwd.layout.name)
        return real_pass(fwd, model, ro)

    monkeypatch.setattr(LogProbForward, "rollout_logprobs", spy)
    layout = LAYOUTS["padding_free"]
    monkeypatch.setitem(LAYOUTS, "padding_free", dataclasses.replace(
        layout, logprobs=lambda *a, **k: packed.append(1) or layout.logprobs(*a, **k)))
    for padding_free in (False, True):
        cfg = _cfg(f"model.padding_free={str(padding_free).lower()}", "loss.kl_coef=0.04", "train.minibatch_size=8",
                   "rollout.max_new_tokens=8", "rollout.temperature=2.0")
        s = _setup(cfg)
        assert s.optim.forward.layout.name == ("padding_free" if padding_free else "padded")
        s.models.policy.double()
        s.models.reference().__enter__().double()
        rows = grpo.train(s)
        results.append(({k: v.clone() for k, v in s.models.policy.state_dict().items()}, rows))
        assert (len(packed) > 0) is padding_free
    # per step: 2 chunks each for π_old and π_ref, 2 epochs × 2 minibatches of one microbatch
    assert len(packed) == 2 * (2 + 2 + 4)
    assert calls == ["padded"] * 4 + ["padding_free"] * 4  # old + ref pass per step, each run
    (want, want_rows), (got, got_rows) = results
    assert [r["len/mean"] for r in got_rows] == [r["len/mean"] for r in want_rows]  # same samples
    for k in want:
        torch.testing.assert_close(got[k], want[k])


@pytest.mark.parametrize("minibatch,microbatch,padding_free", [(8, 4, False), (16, 8, False), (16, 8, True)])
def test_shared_prompt_forwards_give_the_same_training(monkeypatch, minibatch, microbatch, padding_free):
    """model.shared_prompt: Phase A's π_old / π_ref passes and Phase B's microbatches forward each
    group's prompt once; Phase B shuffles whole groups. In fp64, with the padded run given the same
    group order, two steps (μ = 2, KL) end at the same weights: with 2 minibatches of 2 one-group
    microbatches (a π_old pass), and with one minibatch of 2 two-group microbatches (epoch 0 records
    π_old from the grouped forward); and the latter with model.padding_free too (packed groups)."""
    import dataclasses

    from grpolab.forward import LAYOUTS, LogProbForward
    from grpolab.forward.shared_prompt import group_permutation

    grouped = []
    for name in ("shared_prompt", "padding_free+shared_prompt"):
        layout = LAYOUTS[name]
        monkeypatch.setitem(LAYOUTS, name, dataclasses.replace(
            layout, logprobs=lambda model, ids, *a, real=layout.logprobs, name=name:
            grouped.append((name, ids.shape[0])) or real(model, ids, *a)))
    real_order = LogProbForward.row_order
    results, orders = [], []
    for shared in (False, True):
        cfg = _cfg(f"model.shared_prompt={str(shared).lower()}", "loss.kl_coef=0.04", f"train.minibatch_size={minibatch}",
                   f"train.microbatch_size={microbatch}", "rollout.max_new_tokens=8", "rollout.temperature=2.0",
                   f"model.padding_free={str(shared and padding_free).lower()}")
        s = _setup(cfg)
        assert s.optim.forward.layout.whole_groups is shared and cfg.needs_old_logp_pass is (minibatch < 16)
        draw = (lambda n, g, gen: group_permutation(n, g, gen)) if not shared else partial(real_order, s.optim.forward)
        monkeypatch.setattr(LogProbForward, "row_order",
                            lambda self, n, g, gen, draw=draw: orders.append(draw(n, g, gen)) or orders[-1])
        s.models.policy.double()
        s.models.reference().__enter__().double()
        rows = grpo.train(s)
        results.append(({k: v.clone() for k, v in s.models.policy.state_dict().items()}, rows))
        assert (len(grouped) > 0) is shared
    # per step, 16 rows in chunks of `microbatch`: the π_old pass (2 minibatches only), the π_ref pass,
    # 2 epochs of 16 rows in Phase B
    chunks = 16 // microbatch
    name = "padding_free+shared_prompt" if padding_free else "shared_prompt"
    assert grouped == [(name, microbatch)] * 2 * ((chunks if minibatch < 16 else 0) + chunks + 2 * chunks)
    half = len(orders) // 2
    for a, b in zip(orders[:half], orders[half:]):
        torch.testing.assert_close(a, b)
        assert bool((b.view(-1, 4) == b.view(-1, 4)[:, :1] + torch.arange(4)).all())  # whole groups
    (want, want_rows), (got, got_rows) = results
    assert [r["len/mean"] for r in got_rows] == [r["len/mean"] for r in want_rows]  # same samples
    for k in want:
        # token log-probs are float32 (fused_token_logprobs): fp64 logits of other GEMM shapes, equal to
        # ~1e-16, can round to neighbouring float32 values (measured: 1.2e-7 on one weight of 1024)
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_every_preset_runs_through_the_same_loop():
    for name in ("onpolicy_sft", "reinforce", "reinforce_norm", "grpo", "dr_grpo", "dapo", "gspo", "rloo"):
        cfg = C.from_preset(name, ["rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=3",
                                   "train.steps=1", "train.minibatch_size=4", "train.microbatch_size=2",
                                   "run.tensorboard=false", "run.progress=false"])
        s = _setup(cfg)
        rows = grpo.train(s)
        assert len(rows) == 1 and rows[0]["step"] == 0, name
        assert rows[0]["grad_norm"] >= 0


def test_microbatches_group_rows_of_similar_length():
    """Phase B splits each (random) minibatch into microbatches of rows sorted by length, so a
    microbatch pads to its own longest row; every row is still trained on exactly once."""
    cfg = _cfg("train.epochs=1", "train.minibatch_size=16", "train.microbatch_size=4", "train.steps=3",
               "rollout.max_new_tokens=8", "rollout.temperature=2.0", "model.shared_prompt=false")  # padded rows
    s = _setup(cfg)
    seen = []

    class Lengths(_Spy):
        def __call__(self, model, micro, normalizer):
            seen.append(micro.completion_lengths.tolist())
            return self.obj(model, micro, normalizer)

    s.optim.objective = Lengths(s.optim.objective)
    grpo.train(s)
    assert len(seen) == 3 * 4 and all(len(m) == 4 for m in seen)
    assert len({n for m in seen for n in m}) > 1  # the rollouts did vary in length
    for step in range(3):
        micro = seen[4 * step : 4 * step + 4]
        assert all(max(a) <= min(b) for a, b in zip(micro, micro[1:])), micro


def test_model_compile_runs_the_old_and_reference_passes_through_the_compiled_wrappers(monkeypatch):
    """With model.compile, Phase A's π_old pass calls train_model (the compiled policy) and the π_ref
    pass the reference factory's compiled wrapper; generation keeps the plain policy."""
    from grpolab.forward.compiled import CompiledBlocks

    cfg = _cfg("model.compile=true", "train.minibatch_size=4", "train.microbatch_size=4", "train.steps=1",
               "loss.kl_coef=0.04")
    assert cfg.needs_old_logp_pass
    s = _setup(cfg)
    seen = []

    def spy(fwd, model, ro):  # records the module, returns zeros instead of compiling it here
        seen.append(model)
        return torch.zeros(ro.loss_mask.shape)

    from grpolab.forward import LogProbForward

    monkeypatch.setattr(LogProbForward, "rollout_logprobs", spy)
    monkeypatch.setattr(grpo, "learn", lambda *a: None)
    generated_by = []
    generate = s.data.engine.generate_with
    monkeypatch.setattr(s.data.engine, "generate_with",
                        lambda model, *a, **k: generated_by.append(model) or generate(model, *a, **k))
    grpo.train(s)
    with s.models.reference() as ref:
        assert seen == [s.models.train_model, ref]
    assert all(isinstance(m, CompiledBlocks) for m in seen) and generated_by == [s.models.policy]


@pytest.mark.parametrize("preset", ["onpolicy_sft", "reinforce", "reinforce_norm"])
def test_presets_without_a_ratio_update_once_per_rollout(preset):
    cfg = C.from_preset(preset, ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=5",
                                 "train.steps=3", "train.microbatch_size=8", "run.tensorboard=false",
                                 "run.progress=false"])
    s = _setup(cfg)
    grpo.train(s)
    steps = {int(st["step"]) for st in s.optim.optimizer.state.values() if "step" in st}
    assert steps <= {3} and s.optim.scheduler.last_epoch == 3  # one optimizer step per rollout (skipped ones count too)
