"""Fixtures of the agent tests: local chat tokenizers (agents_chat.py), no download."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from agents_chat import TOOLS_TEMPLATE, build_chat_tokenizer


@pytest.fixture(scope="module")
def chat_tok() -> PreTrainedTokenizerFast:
    """The char ChatML tokenizer with SmolLM2's template (no tools)."""
    return build_chat_tokenizer()


@pytest.fixture(scope="module")
def tools_tok() -> PreTrainedTokenizerFast:
    """The char ChatML tokenizer with a template that renders `tools`."""
    return build_chat_tokenizer(TOOLS_TEMPLATE)
