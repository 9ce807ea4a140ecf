"""The compiled decode loop (rollout.compile) samples from the same distribution as the eager one."""

from __future__ import annotations

import gc
import weakref

import torch

from grpolab.forward import attention, batched_logprobs
from grpolab.forward.math_attention import short_attention
from grpolab.rollout import static
from grpolab.rollout.hf import HFEngine

# prompts of different widths: the static loop pads them further on the left, to a bucket of 16
PROMPTS = ["12+7=", "3-1=", "99+99=", "1234+5678="]


def _generate(model, tok, compile_, greedy, seed=3):
    eng = HFEngine(tok, max_new_tokens=12, compile=compile_)
    return eng.generate_with(model, PROMPTS, 3, generator=torch.Generator().manual_seed(seed), greedy=greedy)


def test_greedy_tokens_equal_the_eager_loop(tiny, monkeypatch):
    model, tok = tiny
    eager = _generate(model, tok, False, True)
    steps = []
    step = static.compiled_step()
    monkeypatch.setattr(static, "compiled_step", lambda: lambda *a: steps.append(1) or step(*a))
    comp = _generate(model, tok, True, True)
    assert len(steps) == comp.completion_ids.shape[1] - 1  # the compiled loop ran every decode step
    assert torch.equal(eager.input_ids, comp.input_ids)
    assert torch.equal(eager.loss_mask, comp.loss_mask) and torch.equal(eager.truncated, comp.truncated)
    torch.testing.assert_close(comp.sampler_logp, eager.sampler_logp)


def test_sampled_log_probs_are_the_policy_s_and_finished_rows_are_padded(tiny):
    """Each sampled token's recorded log-prob equals a plain full forward's (cache, mask and
    positions of the static loop are right); after its EOS a row holds pad with log-prob 0."""
    model, tok = tiny
    ro = _generate(model, tok, True, False)
    assert (~ro.truncated).any() and ro.truncated.any()  # some rows finished early, some did not
    ref = batched_logprobs(model, ro, 1.0, 64)
    torch.testing.assert_close(ro.sampler_logp[ro.loss_mask], ref[ro.loss_mask])
    after_eos = ~ro.loss_mask
    assert (ro.completion_ids[after_eos] == tok.pad_token_id).all()
    assert (ro.sampler_logp[after_eos] == 0).all()


def test_the_compiling_rollout_does_not_leave_its_static_cache_behind(tiny, monkeypatch):
    """Dynamo keeps the compiling call's arguments (the static cache among them) in reference cycles;
    the engine collects them after a rollout that compiled, so the cache does not outlive the call.
    Python's own collector is paused: it would free them at some later, unknown time."""
    model, tok = tiny
    caches, new_cache = [], static.new_static_cache
    monkeypatch.setattr(static, "new_static_cache", lambda *a: caches.append(c := new_cache(*a)) or c)
    eng = HFEngine(tok, max_new_tokens=6, compile=True)
    gc.disable()
    try:
        eng.generate_with(model, PROMPTS[:3], 5, generator=torch.Generator().manual_seed(0))  # 15 rows: a new graph
        cache = weakref.ref(caches.pop())
        assert cache() is None
    finally:
        gc.enable()


def test_static_cache_repeat_shares_each_prompt_among_its_group(tiny):
    model, _ = tiny
    cache = static.new_static_cache(model, 8)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6], [7, 8]]), use_cache=True, **{_cache_kwarg(model): cache})
    before = cache.layers[0].keys.clone()
    cache.batch_repeat_interleave(3)
    after = cache.layers[0].keys
    assert after.shape[0] == 6 and cache.layers[0].batch_size == 6
    torch.testing.assert_close(after, before.repeat_interleave(3, dim=0), rtol=0, atol=0)


def test_a_model_without_a_static_cache_uses_the_eager_loop(tiny, monkeypatch):
    model, tok = tiny
    monkeypatch.setattr(static, "new_static_cache", lambda *a, **k: None)
    out = _generate(model, tok, True, True)
    torch.testing.assert_close(out.sampler_logp, _generate(model, tok, False, True).sampler_logp)


def _cache_kwarg(model) -> str:
    from grpolab.rollout.hf import cache_kwarg as kwarg

    return kwarg(type(model))


def test_a_fresh_bf16_copy_per_rollout_does_not_recompile_the_step(tiny):
    """rollout.bf16_weights makes a new module every rollout: the compiled step must treat its
    parameters as inputs, not recompile for each copy."""
    import torch._dynamo

    import copy

    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    eng = HFEngine(tok, max_new_tokens=6, compute_dtype=torch.bfloat16, compile=True, bf16_weights=True)
    first = eng.generate_with(model, PROMPTS, 2, generator=torch.Generator().manual_seed(0))  # compiles
    with torch.no_grad():
        model.lm_head.weight.add_(0.01)  # an optimizer step between rollouts
    # torch's own patch, not monkeypatch: pytest 9.2's undo deletes the attribute (a torch config
    # entry, not in the module's __dict__), which hides it and breaks dynamo's next recompilation
    with torch._dynamo.config.patch(error_on_recompile=True):
        second = eng.generate_with(model, PROMPTS, 2, generator=torch.Generator().manual_seed(0))
    assert not torch.equal(first.sampler_logp, second.sampler_logp)  # the new weights were used


def test_bf16_compiled_loop_runs_decode_attention_and_records_the_policy_s_log_probs(tiny, monkeypatch):
    """Under bf16 the compiled decode steps call no SDPA kernel (their attention is
    `decode_attention`; the eager prefill of these short prompts runs `short_attention`), and each
    sampled token's recorded log-prob is still a full bf16 forward's."""
    import copy

    from torch.profiler import ProfilerActivity, profile

    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    eng = HFEngine(tok, max_new_tokens=12, compute_dtype=torch.bfloat16, compile=True)
    eng.generate_with(model, PROMPTS, 3, generator=torch.Generator().manual_seed(3))  # compiles
    short_calls = []
    monkeypatch.setattr(attention, "short_attention", lambda *a, **k: short_calls.append(1) or short_attention(*a, **k))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ro = eng.generate_with(model, PROMPTS, 3, generator=torch.Generator().manual_seed(3))
    sdpa = [e.count for e in prof.key_averages() if "scaled_dot_product" in e.key and "flash" in e.key]
    assert ro.completion_ids.shape[1] > 2 and sum(sdpa) == 0
    assert len(short_calls) == model.config.num_hidden_layers  # the prefill, once per layer
    ref = batched_logprobs(model, ro, 1.0, 64, compute_dtype=torch.bfloat16)
    # bf16: the fused compiled step and the eager forward round differently (measured: max 0.002)
    torch.testing.assert_close(ro.sampler_logp[ro.loss_mask], ref[ro.loss_mask], atol=1e-2, rtol=1e-2)
