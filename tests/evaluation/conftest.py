"""Fixtures of the evaluation tests."""

from __future__ import annotations

import pytest

from grpolab.models.tiny import build_char_tokenizer, build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random-init 2-layer tiny model and its character tokenizer, saved as an HF folder."""
    path = tmp_path_factory.mktemp("m")
    tok = build_char_tokenizer()
    build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return path
