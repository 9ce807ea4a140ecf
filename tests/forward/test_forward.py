"""The bf16-on-CPU attention switch: same log-probs and gradients as plain SDPA, inference untouched."""

from __future__ import annotations

import copy

import pytest
import torch

from grpolab.algo.logprobs import token_logprobs
from grpolab.forward import attention, batched_logprobs, completion_logprobs
from grpolab.forward.attention import FAST_CPU_ATTENTION, decode_attention, use_fast_cpu_attention
from grpolab.forward.math_attention import short_attention
from grpolab.models.tiny import build_char_tokenizer, build_tiny_model


@pytest.fixture(scope="module")
def model_and_batch():
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden_size=64, num_layers=2, num_heads=4, seed=0)
    enc = tok(["12+7=34", "3-1=2", "99+99=198"], return_tensors="pt", padding=True, add_special_tokens=False)
    return model, enc["input_ids"], enc["attention_mask"].bool()


def _logp_and_grad(model, ids, am, dtype):
    model.zero_grad(set_to_none=True)
    logp, _ = completion_logprobs(model, ids, am, 4, compute_dtype=dtype)
    (logp * am[:, 4:]).sum().backward()
    return logp.detach(), model.model.embed_tokens.weight.grad.clone()


def test_switch_only_for_bf16_on_cpu(model_and_batch):
    model = copy.deepcopy(model_and_batch[0])
    use_fast_cpu_attention(model, None, "cpu")
    assert model.config._attn_implementation == "sdpa"
    use_fast_cpu_attention(model, torch.bfloat16, "cpu")
    assert model.config._attn_implementation == FAST_CPU_ATTENTION
    use_fast_cpu_attention(model, torch.bfloat16, "cpu")  # idempotent
    assert model.config._attn_implementation == FAST_CPU_ATTENTION


def test_fp32_attention_in_bf16_training_matches_fp32_to_bf16_precision(model_and_batch):
    base, ids, am = model_and_batch
    ref_lp, ref_g = _logp_and_grad(copy.deepcopy(base), ids, am, None)  # fp32 throughout
    plain = copy.deepcopy(base)  # bf16 autocast with bf16 SDPA (the model call bypasses the switch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = plain(input_ids=ids, attention_mask=am.long(), use_cache=False)
    plain_lp = token_logprobs(out.logits[:, 3:-1], ids[:, 4:])
    (plain_lp * am[:, 4:]).sum().backward()
    plain_g = plain.model.embed_tokens.weight.grad
    fast = copy.deepcopy(base)
    fast_lp, fast_g = _logp_and_grad(fast, ids, am, torch.bfloat16)
    assert fast.config._attn_implementation == FAST_CPU_ATTENTION
    m = am[:, 4:]
    # bf16 autocast: log-probs agree with fp32 and with bf16 SDPA to bf16 precision (8-bit mantissa)
    torch.testing.assert_close(fast_lp[m], ref_lp[m], rtol=0.02, atol=0.05)
    torch.testing.assert_close(fast_lp[m], plain_lp.detach()[m], rtol=0.02, atol=0.05)
    # gradients: the relative error to fp32 is of bf16 size, and not worse than bf16 SDPA's
    fast_err = float((fast_g - ref_g).norm() / ref_g.norm())
    plain_err = float((plain_g - ref_g).norm() / ref_g.norm())
    assert fast_err < 0.03, fast_err
    assert fast_err <= plain_err * 1.25, (fast_err, plain_err)


def test_inference_logprobs_unchanged_by_the_switch_beyond_short_sequences(model_and_batch, monkeypatch):
    base, ids, am = model_and_batch
    plain, fast = copy.deepcopy(base), copy.deepcopy(base)
    fast.set_attn_implementation("sdpa")
    use_fast_cpu_attention(fast, torch.bfloat16, "cpu")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        a = plain(input_ids=ids, attention_mask=am.long()).logits
        short = fast(input_ids=ids, attention_mask=am.long()).logits
        monkeypatch.setattr(attention, "SHORT_ATTENTION_MAX_TOKENS", ids.shape[1] - 1)  # these rows are now "long"
        long = fast(input_ids=ids, attention_mask=am.long()).logits
    torch.testing.assert_close(a, long, rtol=0, atol=0)  # no grad, long rows: the same bf16 SDPA kernel runs
    assert not torch.equal(a, short)  # short rows: short_attention ran, ...
    torch.testing.assert_close(short, a, rtol=0.02, atol=0.05)  # ... equal to bf16 precision


def test_grad_and_no_grad_forwards_give_the_same_logprobs(model_and_batch):
    """π_old / π_ref (no grad) and the training forward (grad) run the same attention on short rows."""
    base, ids, am = model_and_batch
    model = copy.deepcopy(base)
    with torch.no_grad():
        no_grad, _ = completion_logprobs(model, ids, am, 4, compute_dtype=torch.bfloat16)
    with_grad, _ = completion_logprobs(model, ids, am, 4, compute_dtype=torch.bfloat16)
    assert with_grad.requires_grad
    torch.testing.assert_close(with_grad.detach(), no_grad, rtol=0, atol=0)


@pytest.mark.parametrize("prompt_len", [0, 9])
def test_prompt_len_outside_the_row_is_a_clear_error(model_and_batch, prompt_len):
    """prompt_len 0: no position predicts the first completion token; >= width: no completion."""
    model, ids, am = model_and_batch
    with pytest.raises(ValueError, match=f"prompt_len={prompt_len} must be in"):
        completion_logprobs(model, ids, am, prompt_len)


def _short_case(kv_heads, mask_kind, lq=7, lk=7):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, lq, 16, generator=g).bfloat16()
    k, v = (torch.randn(3, kv_heads, lk, 16, generator=g).bfloat16() for _ in range(2))
    if mask_kind == "causal":
        return q, k, v, None, torch.ones(lq, lk, dtype=torch.bool).tril()
    keep = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq).expand(3, 1, lq, lk).clone()
    keep[0, :, :, :2] = False  # row 0: two left-padding keys
    keep[1, :, :3, :] = False  # row 1: its first three queries see nothing (padding positions)
    keep[1, :, 3:, :3] = False
    return q, k, v, keep, keep


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("mask_kind", ["causal", "bool"])
def test_short_attention_matches_float32_sdpa_and_its_gradient(kv_heads, mask_kind):
    q, k, v, mask, keep = _short_case(kv_heads, mask_kind, lq=5 if mask_kind == "bool" else 7,
                                      lk=8 if mask_kind == "bool" else 7)
    leaves = [x.float().requires_grad_() for x in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=keep, scale=0.3,
                                                           enable_gqa=kv_heads != 4)
    seen = keep.expand(3, 4, *keep.shape[-2:]).any(-1)  # queries with at least one key
    grad_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2)) * seen[..., None]
    ref.backward(grad_out)
    inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = short_attention(*inputs, mask, scaling=0.3)
    assert out.dtype == torch.bfloat16 and out.shape == (3, q.shape[2], 4, 16)
    out.transpose(1, 2).float().backward(grad_out)
    got = out.transpose(1, 2).float()
    assert torch.isfinite(got).all()
    # values: float32 SDPA on the same bf16 inputs, to bf16 rounding of the scores, probabilities and output
    torch.testing.assert_close(got[seen], ref.detach()[seen], rtol=0.02, atol=0.02)
    for mine, theirs in zip(inputs, leaves):
        err = float((mine.grad.float() - theirs.grad).norm() / theirs.grad.norm())
        assert err < 0.02, err  # bf16 matmuls: relative error of bf16 size (float32 would be ~1e-6)
    if mask_kind == "bool":  # a query that sees nothing gets 0, as from SDPA
        assert not seen[1, :, :3].any() and ref.detach()[1, :, :3].abs().max() == 0
        assert got[1, :, :3].abs().max() == 0


def test_short_attention_serves_short_bf16_rows_only():
    from types import SimpleNamespace

    module = SimpleNamespace(is_causal=True)
    q = torch.zeros(2, 4, 9, 8, dtype=torch.bfloat16)
    k = torch.zeros(2, 4, 9, 8, dtype=torch.bfloat16)
    keep = torch.ones(2, 1, 9, 9, dtype=torch.bool)
    assert attention.is_short(module, q, k, None, {})
    assert attention.is_short(module, q, k, keep, {"dropout": 0.0})
    assert not attention.is_short(module, q.float(), k.float(), None, {})  # float32 compute
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attention.is_short(module, q.float(), k.float(), None, {})  # bf16 autocast
    assert not attention.is_short(module, q, k, keep.float(), {})  # additive masks go to SDPA
    assert not attention.is_short(module, q, k, keep, {"dropout": 0.1})
    assert not attention.is_short(module, q[:, :, :1], k, keep[:, :, :1], {})  # a decode step
    assert not attention.is_short(module, q[:, :, :5], k, None, {})  # causal needs equal lengths
    assert not attention.is_short(SimpleNamespace(is_causal=False), q, k, None, {})
    n = attention.SHORT_ATTENTION_MAX_TOKENS + 1
    assert not attention.is_short(module, q.new_zeros(1, 4, n, 8), k.new_zeros(1, 4, n, 8), None, {})


@pytest.fixture(scope="module")
def rollout(model_and_batch):
    from grpolab.rollout.hf import HFEngine

    model = model_and_batch[0]
    tok = build_char_tokenizer()
    eng = HFEngine(tok, max_new_tokens=12)
    return eng.generate_with(model, ["1+1=", "12+34=", "7="], 4, generator=torch.Generator().manual_seed(0))


def test_batched_logprobs_bucketed_equals_one_chunk(model_and_batch, rollout):
    model = model_and_batch[0].eval()
    one = batched_logprobs(model, rollout, 1.0, batch_size=rollout.num_sequences)
    bucketed = batched_logprobs(model, rollout, 1.0, batch_size=3)
    m = rollout.loss_mask
    assert m.sum() > 0
    torch.testing.assert_close(bucketed[m], one[m])


@pytest.mark.slow  # torch.compile takes 30-60 s on this CPU
@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_compiled_training_module_matches_eager_and_shares_parameters(model_and_batch, scope):
    from torch._dynamo.eval_frame import OptimizedModule

    from grpolab.forward.compiled import CompiledBlocks, training_module

    model, ids, am = model_and_batch
    model = copy.deepcopy(model).train()
    assert training_module(model, False) is model
    compiled = training_module(model, True, scope=scope)
    assert isinstance(compiled, CompiledBlocks if scope == "blocks" else OptimizedModule)
    assert {id(p) for p in compiled.parameters()} == {id(p) for p in model.parameters()}
    want_logp, want_grad = _logp_and_grad(model, ids, am, None)
    for width in (ids.shape[1], ids.shape[1] - 2):  # a second width reuses the dynamic-shape graph
        model.zero_grad(set_to_none=True)
        logp, _ = completion_logprobs(compiled, ids[:, :width], am[:, :width], 4)
        (logp * am[:, 4:width]).sum().backward()
        # fused kernels reorder fp32 sums: agreement to ~1e-5, not bit-for-bit
        torch.testing.assert_close(logp.detach(), want_logp[:, : width - 4], rtol=1e-4, atol=1e-5)
        if width == ids.shape[1]:
            torch.testing.assert_close(model.model.embed_tokens.weight.grad, want_grad, rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # the no-grad π_old / π_ref passes call the same wrapper (a second graph)
        logp, _ = completion_logprobs(compiled, ids, am, 4)
    torch.testing.assert_close(logp, want_logp, rtol=1e-4, atol=1e-5)  # fused kernels: as above
    # calls of the model itself (generation) stay eager
    assert all(layer._compiled_call_impl is None for layer in model.model.layers)


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("mask_kind", ["bool", "additive", "none"])
def test_decode_attention_matches_sdpa(kv_heads, mask_kind):
    """One query row per (row, head) over a cache, grouped-query or not: the values of float32
    SDPA on the same bf16 inputs, rounded to bf16."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 1, 16, generator=g).bfloat16()
    k, v = (torch.randn(5, kv_heads, 9, 16, generator=g).bfloat16() for _ in range(2))
    keep = torch.rand(5, 1, 1, 9, generator=g) > 0.4
    keep[..., -1] = True  # the new token always sees itself
    mask = {"bool": keep, "additive": torch.zeros(keep.shape).masked_fill(~keep, float("-inf")), "none": None}[mask_kind]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, scale=0.3, enable_gqa=kv_heads != 4)
    out, weights = decode_attention(q, k, v, mask, scaling=0.3)
    assert weights is None and out.dtype == torch.bfloat16 and out.shape == (5, 1, 4, 16)
    torch.testing.assert_close(out, ref.transpose(1, 2).bfloat16())
