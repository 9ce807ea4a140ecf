"""Local chat tokenizers and templates for the agent tests: character-level, with ChatML control tokens, no download.

Vocabulary: <pad>, <bos>, <|im_start|>, <|im_end|> (the EOS: the end of an assistant turn), then one
token per printable ASCII character and "\\n", then the whole-word token "cannot" (so that a text
spelled character by character re-encodes differently: the tests use it to show that the policy's
ids are kept as sampled, never decoded and re-encoded).
"""

from __future__ import annotations

from grpolab.models.tiny_chat import SMOLLM2_TEMPLATE, SPECIALS, TOOLS_TEMPLATE, WORD  # noqa: F401
from grpolab.models.tiny_chat import build_char_chat_tokenizer as build_chat_tokenizer  # noqa: F401

DROP_REASONING_TEMPLATE = (  # Qwen3-like: assistant turns before the last user message lose their <think> part
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}{%- set content = m['content'] %}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + content + '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)
