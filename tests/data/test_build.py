"""grpolab.data.build: the config's data section drives the prompt sources (chat template, field names)."""

import copy
import json

import pytest

from grpolab import config as C
from grpolab.data.build import prompt_stream


def _cfg(path, *overrides):
    return C.from_preset("grpo", [f"data.source=jsonl:{path}", *overrides])


def _prompts(cfg, tok):
    stream = prompt_stream(cfg, tok)
    return sorted(it.prompt for it in stream.items)


def test_chat_template_auto_true_false_and_field_names(tmp_path, tok):
    f = tmp_path / "q.jsonl"
    f.write_text(json.dumps({"question": "2+3?", "answer": "5"}) + "\n")
    templated = _prompts(_cfg(f, "data.prompt_field=question"), tok)  # auto: the tokenizer has a template
    assert templated == ["<|im_start|>system\nDEFAULT SYSTEM<|im_end|>\n<|im_start|>user\n2+3?<|im_end|>\n"
                         "<|im_start|>assistant\n"]
    assert _prompts(_cfg(f, "data.prompt_field=question", "data.chat_template=true"), tok) == templated
    assert _prompts(_cfg(f, "data.prompt_field=question", "data.chat_template=false"), tok) == ["2+3?"]
    plain = copy.deepcopy(tok)
    plain.chat_template = None
    assert _prompts(_cfg(f, "data.prompt_field=question"), plain) == ["2+3?"]  # auto without a template
    with pytest.raises(C.ConfigError, match="data.chat_template=true but the tokenizer .* has no chat template"):
        prompt_stream(_cfg(f, "data.prompt_field=question", "data.chat_template=true"), plain)
    with pytest.raises(ValueError, match=r"q\.jsonl:1: needs exactly one of the fields 'prompt' or 'messages'"):
        prompt_stream(_cfg(f), tok)  # the default field name is not in this file


def test_messages_field_and_a_bad_chat_template_value(tmp_path, tok):
    f = tmp_path / "m.jsonl"
    f.write_text(json.dumps({"chat": [{"role": "user", "content": "hi"}]}) + "\n")
    prompts = _prompts(_cfg(f, "data.messages_field=chat", "data.system_prompt=''"), tok)
    assert prompts == ["<|im_start|>system\n<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"]
    with pytest.raises(C.ConfigError, match="data.chat_template='maybe' is not one of auto, true, false"):
        _cfg(f, "data.chat_template=maybe")
