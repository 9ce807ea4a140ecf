"""Fixtures of the log-prob forward tests in other layouts (test_packed.py, test_shared_prompt.py):
two small models and a real rollout, compared against the padded forward."""

from __future__ import annotations

import copy

import pytest
import torch

from grpolab.models.tiny import build_char_tokenizer, build_tiny_model


def _gqa_llama(vocab: int) -> torch.nn.Module:
    """A 2-layer Llama with grouped-query attention (4 query heads over 2 key/value heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float()


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module", params=["qwen2", "gqa-llama"])
def model(request, tok):
    if request.param == "qwen2":
        return build_tiny_model(tok, hidden_size=64, num_layers=2, num_heads=4, seed=0)
    return _gqa_llama(len(tok))


@pytest.fixture(scope="module")
def rollout(tok):
    """A real rollout layout: 3 groups of 4 rows, left-padded prompts of 3 lengths, completions of
    many lengths."""
    from grpolab.rollout.hf import HFEngine

    sampler = build_tiny_model(tok, hidden_size=64, num_layers=2, num_heads=4, seed=1)
    eng = HFEngine(tok, max_new_tokens=12)
    ro = eng.generate_with(sampler, ["1+1=", "12+34=", "7="], 4, generator=torch.Generator().manual_seed(0))
    lengths = ro.completion_lengths
    assert lengths.min() < lengths.max() and ro.attention_mask[:, 0].sum() < ro.num_sequences  # padding on both sides
    return ro


def _compiled_keeps_graphs(model, first, later, logp_grad, recompiled: str) -> None:
    """torch.compile(model) (dynamic, aot_eager) run on `first` compiles; each rollout of `later` must
    reuse those graphs (else AssertionError `recompiled`) and give the eager log-probs, entropies and
    gradients. logp_grad(module, rollout) -> (logp, entropy, flat gradient)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    m = copy.deepcopy(model).train()
    counter = CompileCounterWithBackend("aot_eager")  # dynamo's guards are inductor's; no C++ build in CI
    compiled = torch.compile(m, dynamic=True, backend=counter)
    logp_grad(compiled, first)
    frames = counter.frame_count
    assert frames > 0
    for ro in later:
        want_lp, want_ent, want_g = logp_grad(m, ro)
        got_lp, got_ent, got_g = logp_grad(compiled, ro)
        assert counter.frame_count == frames, recompiled
        torch.testing.assert_close(got_lp, want_lp)
        torch.testing.assert_close(got_ent, want_ent)
        # aot_eager runs decomposed ops (the RMSNorm's, the rotary's): fp32 sums in another order
        torch.testing.assert_close(got_g, want_g, rtol=1e-4, atol=1e-6)
    torch._dynamo.reset()


@pytest.fixture
def compiled_keeps_graphs():
    """`_compiled_keeps_graphs`: a compiled forward reuses its graphs for other batches, eager values."""
    return _compiled_keeps_graphs
