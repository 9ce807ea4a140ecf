"""models/tiny_chat.py: the character-level chat tokenizer and its whole-word tokens."""

from __future__ import annotations

from grpolab.models.tiny_chat import TOOLS_TEMPLATE, build_char_chat_tokenizer


def test_words_are_one_token_each_and_the_rest_is_characters():
    plain = build_char_chat_tokenizer(TOOLS_TEMPLATE)
    tok = build_char_chat_tokenizer(TOOLS_TEMPLATE, words=("<tool_call>", "<tool", "higher"))
    text = "<tool_call>higher 12<tool x"
    pieces = tok.convert_ids_to_tokens(tok(text, add_special_tokens=False)["input_ids"])
    assert pieces == ["<tool_call>", "higher", " ", "1", "2", "<tool", " ", "x"]  # the longest word wins
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert len(tok) == len(plain) + 3
    assert plain.convert_ids_to_tokens(plain("cannot go")["input_ids"])[:2] == ["cannot", " "]
    assert {c: plain.convert_tokens_to_ids(c) for c in "ab1"} == {c: tok.convert_tokens_to_ids(c) for c in "ab1"}
