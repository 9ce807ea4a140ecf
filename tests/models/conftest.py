"""Fixtures of the log-prob forward tests in other layouts (test_packed.py, test_shared_prompt.py):
two small models and a real rollout, compared against the padded forward."""

from __future__ import annotations

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
    ro = eng.generate(sampler, ["1+1=", "12+34=", "7="], 4, generator=torch.Generator().manual_seed(0))
    lengths = ro.completion_lengths
    assert lengths.min() < lengths.max() and ro.attention_mask[:, 0].sum() < ro.num_sequences  # padding on both sides
    return ro
