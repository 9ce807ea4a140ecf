"""HFEngine with rollout.bf16_weights (sampling from a per-call bfloat16 copy of the policy); the heap policy."""

from __future__ import annotations

import copy

import pytest
import torch

from grpolab.models.tiny import build_char_tokenizer, build_tiny_model
from grpolab.rollout.hf import HFEngine

PROMPTS = ["12+7=", "3-1=", "99+99="]


@pytest.fixture(scope="module")
def tiny():
    tok = build_char_tokenizer()
    return build_tiny_model(tok, hidden_size=64, num_layers=2, num_heads=4, seed=0), tok


def test_bf16_weights_samples_from_the_bf16_copy_and_restores_the_policy(tiny):
    model, tok = tiny
    model.train()

    def generate(policy, bf16_weights):
        eng = HFEngine(tok, max_new_tokens=10, compute_dtype=torch.bfloat16, bf16_weights=bf16_weights)
        return eng.generate(policy, PROMPTS, 2, generator=torch.Generator().manual_seed(0))

    ro = generate(model, True)
    assert model.training and next(model.parameters()).dtype == torch.float32
    # the same samples and log-probs as generating from a copy with its parameters cast (buffers
    # such as the rotary frequencies stay float32) ...
    cast = copy.deepcopy(model)
    for p in cast.parameters():
        p.data = p.data.to(torch.bfloat16)
    cast = generate(cast, False)
    assert torch.equal(ro.input_ids, cast.input_ids) and torch.equal(ro.loss_mask, cast.loss_mask)
    torch.testing.assert_close(ro.sampler_logp, cast.sampler_logp, rtol=0, atol=0)
    # ... and not those of the float32 weights under autocast (the default)
    plain = generate(model, False)
    assert not torch.equal(ro.sampler_logp, plain.sampler_logp)


class _FakeLibc:
    """Records the glibc calls of release_free_memory / keep_freed_memory."""

    def __init__(self):
        self.calls = []

    def malloc_trim(self, pad):
        self.calls.append(("malloc_trim", pad))

    def mallopt(self, param, value):
        self.calls.append(("mallopt", param, value))
        return 1


def test_keep_freed_memory_raises_the_thresholds_and_stops_the_trims(monkeypatch):
    import grpolab.rollout.hf as hf

    libc = _FakeLibc()
    monkeypatch.setattr(hf, "_LIBC", libc)
    monkeypatch.setattr(hf, "_KEEP_FREED", False)  # restored after the test: the switch is process-wide
    hf.release_free_memory()
    assert libc.calls == [("malloc_trim", 0)]
    assert hf.keep_freed_memory() is True
    assert libc.calls[1:] == [("mallopt", -3, 1 << 30), ("mallopt", -1, 1 << 30)]  # M_MMAP_, M_TRIM_THRESHOLD
    hf.release_free_memory()
    assert len(libc.calls) == 3  # no further trim


def test_keep_freed_memory_without_glibc_changes_nothing(monkeypatch):
    import grpolab.rollout.hf as hf

    monkeypatch.setattr(hf, "_LIBC", False)
    monkeypatch.setattr(hf, "_KEEP_FREED", False)
    assert hf.keep_freed_memory() is False
    assert hf._KEEP_FREED is False
