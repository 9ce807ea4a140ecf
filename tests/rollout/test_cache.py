"""The pre-allocated KV cache holds what a DynamicCache holds, and the engine samples the same tokens."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from grpolab.rollout.cache import PreallocatedCache, PreallocatedLayer, new_decode_cache
from grpolab.rollout.hf import HFEngine


def _kv(b, t, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 2, t, 4, generator=g), torch.randn(b, 2, t, 4, generator=g)


def test_layer_matches_dynamic_layer_through_repeat_select_and_growth():
    pre, dyn = PreallocatedLayer(extra_tokens=2), DynamicLayer()
    k, v = _kv(3, 5, 0)
    for layer in (pre, dyn):
        layer.update(k, v)
        layer.batch_repeat_interleave(2)  # 6 rows
    for step in range(4):  # the 3rd and 4th steps go past the planned room: the buffer grows
        k, v = _kv(6 if step < 2 else 4, 1, step + 1)
        if step == 2:
            idx = torch.tensor([0, 2, 3, 5])
            pre.batch_select_indices(idx)
            dyn.batch_select_indices(idx)
        kp, vp = pre.update(k, v)
        kd, vd = dyn.update(k, v)
        torch.testing.assert_close(kp, kd, rtol=0, atol=0)
        torch.testing.assert_close(vp, vd, rtol=0, atol=0)
        assert pre.get_seq_length() == dyn.get_seq_length() == 5 + step + 1


def test_crop_rejects_positive_and_shortens():
    layer = PreallocatedLayer(extra_tokens=4)
    layer.update(*_kv(1, 3, 0))
    with pytest.raises(ValueError, match="tokens_to_remove"):
        layer.crop(1)
    layer.crop(-1)
    assert layer.get_seq_length() == 2 and layer.keys.shape[-2] == 2


def test_new_decode_cache_for_a_full_attention_model(tiny):
    model, _ = tiny
    cache = new_decode_cache(model, 8)
    assert isinstance(cache, PreallocatedCache) and len(cache.layers) == 2
    assert new_decode_cache(torch.nn.Linear(2, 2), 8) is None  # no config: the model's own cache


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_engine_same_samples_with_and_without_preallocated_cache(tiny, dtype):
    model, tok = tiny
    prompts = ["12+7=", "3-1=", "99+99="]
    out = []
    for pre in (False, True):
        eng = HFEngine(tok, max_new_tokens=10, compute_dtype=dtype, preallocate_cache=pre)
        out.append(eng.generate_with(model, prompts, 4, generator=torch.Generator().manual_seed(3)))
    a, b = out
    assert torch.equal(a.input_ids, b.input_ids)
    assert torch.equal(a.loss_mask, b.loss_mask)
    torch.testing.assert_close(a.sampler_logp, b.sampler_logp)
    assert a.truncated.any() or (~a.truncated).any()


def test_bf16_weights_cast_once_gives_the_same_samples_as_autocast_per_step(tiny, monkeypatch):
    """The engine holds one autocast region over the loop; entering one per step must not differ."""
    import contextlib

    from grpolab.rollout import hf

    model, tok = tiny
    prompts = ["12+7=", "3-1="]
    once = HFEngine(tok, max_new_tokens=10, compute_dtype=torch.bfloat16).generate_with(
        model, prompts, 4, generator=torch.Generator().manual_seed(5))
    real = hf.autocast
    monkeypatch.setattr(hf, "autocast", lambda *a, **k: contextlib.nullcontext())
    eng = HFEngine(tok, max_new_tokens=10, compute_dtype=torch.bfloat16)
    inner = eng._forward

    def per_step(model, cache=None, **kw):
        with real(torch.bfloat16, "cpu"):
            return inner(model, cache, **kw)

    eng._forward = per_step
    each = eng.generate_with(model, prompts, 4, generator=torch.Generator().manual_seed(5))
    assert torch.equal(once.input_ids, each.input_ids)
    torch.testing.assert_close(once.sampler_logp, each.sampler_logp)
