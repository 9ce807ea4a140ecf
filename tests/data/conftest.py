"""Shared fixtures of the data tests."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

# like SmolLM2's template: a default system prompt is inserted when the messages have none
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nDEFAULT SYSTEM<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    """Byte-level tokenizer without merges (one token per ASCII character, plus two specials) with
    CHAT_TEMPLATE."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    specials = ["<|im_start|>", "<|im_end|>"]
    core = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(specials + sorted(alphabet))}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    t = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                additional_special_tokens=["<|im_start|>"])
    t.chat_template = CHAT_TEMPLATE
    return t
