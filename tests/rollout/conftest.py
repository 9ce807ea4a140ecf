"""The small policy the rollout tests sample from."""

import pytest

from grpolab.models.tiny import build_char_tokenizer, build_tiny_model


@pytest.fixture(scope="module")
def tiny():
    """(a 2-layer, 64-wide char-level Qwen2 in eval mode, its tokenizer); one per test module."""
    tok = build_char_tokenizer()
    return build_tiny_model(tok, hidden_size=64, num_layers=2, num_heads=4, seed=0).eval(), tok
