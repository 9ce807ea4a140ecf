"""rollout.packed_weights: the eager decode loop on oneDNN-packed float32 weights samples from the
same distribution, and the model is left as it was."""

from __future__ import annotations

import pytest
import torch

from grpolab.forward import batched_logprobs
from grpolab.models.tiny import build_char_tokenizer, build_tiny_model
from grpolab.rollout import packed
from grpolab.rollout.hf import HFEngine

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")

PROMPTS = ["12+7=", "3-1=", "99+99=", "1234+5678="]


def _generate(model, tok, packed_weights, greedy, seed=3):
    eng = HFEngine(tok, max_new_tokens=12, packed_weights=packed_weights)
    return eng.generate_with(model, PROMPTS, 3, generator=torch.Generator().manual_seed(seed), greedy=greedy)


def _linears(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def test_greedy_tokens_equal_the_plain_loop_and_the_packed_products_ran(tiny, monkeypatch):
    model, tok = tiny
    plain = _generate(model, tok, False, True)
    calls = []
    pack = packed._packed_forward
    monkeypatch.setattr(packed, "_packed_forward", lambda m, rows: calls.append(rows) or pack(m, rows))
    ro = _generate(model, tok, True, True)
    assert calls == [len(PROMPTS) * 3] * len(_linears(model))  # every linear layer, packed for N rows
    assert torch.equal(plain.input_ids, ro.input_ids)
    assert torch.equal(plain.loss_mask, ro.loss_mask) and torch.equal(plain.truncated, ro.truncated)
    torch.testing.assert_close(ro.sampler_logp, plain.sampler_logp)


def test_sampled_log_probs_are_the_policy_s(tiny):
    """Each sampled token's recorded log-prob equals a plain (MKL) full forward's."""
    model, tok = tiny
    ro = _generate(model, tok, True, False)
    ref = batched_logprobs(model, ro, 1.0, 64)
    torch.testing.assert_close(ro.sampler_logp[ro.loss_mask], ref[ro.loss_mask])


def test_the_block_restores_every_layer_even_after_an_error(tiny):
    model, _ = tiny
    x = torch.randn(5, 64)
    layer = _linears(model)[0]
    before = layer(x)
    with pytest.raises(RuntimeError, match="inside"):
        with packed.packed_linears(model, 5):
            assert all("forward" in m.__dict__ for m in _linears(model))
            torch.testing.assert_close(layer(x), before)  # the packed product, to float rounding
            raise RuntimeError("inside")
    assert not any("forward" in m.__dict__ for m in _linears(model))
    assert torch.equal(layer(x), before)


def test_a_layer_whose_forward_is_replaced_already_is_left_alone(tiny):
    model, _ = tiny
    layer = _linears(model)[0]
    hooked = lambda x: torch.zeros(x.shape[0], layer.out_features)  # noqa: E731 - e.g. accelerate's hook
    layer.forward = hooked
    try:
        with packed.packed_linears(model, 4):
            assert layer.forward is hooked
            assert all("forward" in m.__dict__ for m in _linears(model)[1:])
        assert layer.forward is hooked
    finally:
        del layer.forward


def test_only_float32_layers_are_packed(tiny):
    model, _ = tiny
    half = build_tiny_model(build_char_tokenizer(), hidden_size=32, num_layers=1, num_heads=2).to(torch.bfloat16)
    with packed.packed_linears(half, 4):
        assert not any("forward" in m.__dict__ for m in _linears(half))
        with packed.packed_linears(model, 4):
            assert all("forward" in m.__dict__ for m in _linears(model))


def test_without_onednn_nothing_is_packed(tiny, monkeypatch):
    model, _ = tiny
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    with packed.packed_linears(model, 4):
        assert not any("forward" in m.__dict__ for m in _linears(model))
