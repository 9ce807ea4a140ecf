"""A character-level chat tokenizer with ChatML control tokens, for tiny local agent models (no download).

Vocabulary: <pad>, <bos>, <|im_start|>, <|im_end|> (the EOS: the end of an assistant turn), then one
token per printable ASCII character and "\\n", then whole-word tokens: "cannot" and any `words` given
(each one token wherever it occurs; longer words win). Two chat templates:
`SMOLLM2_TEMPLATE` (SmolLM2-135M-Instruct's, no tool support: tools then take the default format of
grpolab.agents.toolcall) and `TOOLS_TEMPLATE` (Qwen2.5-like: the template renders `tools`, and tool
results as a user <tool_response> turn).
"""

from __future__ import annotations

import re
import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ("<pad>", "<bos>", "<|im_start|>", "<|im_end|>")
WORD = "cannot"

SMOLLM2_TEMPLATE = (  # SmolLM2-135M-Instruct's chat template, as read from its GGUF: no tool support
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TOOLS_TEMPLATE = (  # a Qwen2.5-like ChatML template with tools (tool results as a user <tool_response>)
    "{%- if tools %}{{ '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{ '# Tools\n<tools>' }}{%- for t in tools %}{{ '\n' + (t | tojson) }}{%- endfor %}"
    "{{ '\n</tools><|im_end|>\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}{{ '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}{%- if m['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + m['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{%- elif m['role'] != 'system' %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)

def build_char_chat_tokenizer(template: str | None = SMOLLM2_TEMPLATE,
                              words: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """The character-level ChatML tokenizer of the module docstring, with `template` as its chat template
    and `words` as whole-word tokens beside "cannot"."""
    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]  # keeps "\n", "\t", " "
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    whole = sorted({WORD, *words}, key=lambda w: (-len(w), w))
    for tok in chars + whole:
        vocab.setdefault(tok, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk-not-in-vocab>"))
    pattern = "|".join(re.escape(w) for w in whole) + r"|[\s\S]"
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>",
                                  eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"],
                                  padding_side="left", clean_up_tokenization_spaces=False, model_max_length=4096)
    tok.chat_template = template
    return tok
