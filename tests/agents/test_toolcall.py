"""grpolab.agents.toolcall: parsing <tool_call> blocks, the default tool format, template tool support."""

import json

import pytest

from agents_chat import DROP_REASONING_TEMPLATE, SMOLLM2_TEMPLATE, TOOLS_TEMPLATE, build_chat_tokenizer
from grpolab.agents.toolcall import (
    MalformedCall,
    ParsedCall,
    parse_tool_calls,
    template_supports_tools,
    tool_result_messages,
    tool_system_prompt,
    with_tool_prompt,
)
from grpolab.agents.tools import ToolOutcome

SCHEMA = {"type": "function", "function": {"name": "calculator", "description": "Evaluates.",
                                           "parameters": {"type": "object", "properties": {}}}}


def test_no_call():
    assert parse_tool_calls("The answer is 42.") == []


def test_calls_with_text_around_them():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
            ' and <tool_call>{"name": "add", "arguments": {}}</tool_call> done')
    assert parse_tool_calls(text) == [ParsedCall("calculator", {"expression": "2*3"}), ParsedCall("add", {})]


@pytest.mark.parametrize("body, reason", [
    ('{"name": "calc", "arguments": {', "invalid JSON (Expecting property name enclosed in double quotes"),
    ('["calc"]', 'expected a JSON object with "name" and "arguments", got list'),
    ('{"arguments": {}}', 'missing "name"'),
    ('{"name": "", "arguments": {}}', 'missing "name"'),
    ('{"name": "calc"}', '"arguments" must be a JSON object, got missing'),
    ('{"name": "calc", "arguments": "{}"}', '"arguments" must be a JSON object, got a str'),
])
def test_malformed_bodies(body, reason):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert isinstance(call, MalformedCall) and call.reason.startswith(reason) and call.text == body


def test_unclosed_tags():
    calls = parse_tool_calls('<tool_call>{"name": "a", "arguments": {}} <tool_call>{"name": "b", "arguments": {}}'
                             '</tool_call> <tool_call>{"name": "c"')
    assert [type(c) for c in calls] == [MalformedCall, ParsedCall, MalformedCall]
    assert calls[0].reason == "unclosed <tool_call> tag (expected </tool_call>)"
    assert calls[0].text.startswith('<tool_call>{"name": "a"') and calls[1].name == "b"
    assert calls[2].text == '<tool_call>{"name": "c"'


def test_a_stray_closing_tag_is_ignored():
    assert parse_tool_calls("</tool_call> nothing") == []


def test_tool_system_prompt_lists_every_schema_and_the_format():
    other = {"type": "function", "function": {"name": "other"}}
    text = tool_system_prompt([SCHEMA, other])
    assert "<tools>\n" + json.dumps(SCHEMA) + "\n" + json.dumps(other) + "\n</tools>" in text
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in text
    assert "<tool_response></tool_response>" in text


def test_with_tool_prompt_extends_or_adds_the_system_message():
    user = {"role": "user", "content": "hi"}
    out = with_tool_prompt([user], [SCHEMA])
    assert out[0] == {"role": "system", "content": tool_system_prompt([SCHEMA])} and out[1] == user
    sys_msg = {"role": "system", "content": "Be brief."}
    out = with_tool_prompt([sys_msg, user], [SCHEMA])
    assert out[0]["content"] == "Be brief.\n\n" + tool_system_prompt([SCHEMA]) and len(out) == 2
    assert sys_msg["content"] == "Be brief."  # the input is not modified


def test_tool_result_messages_native_and_default():
    outcomes = [ToolOutcome("calc", "6"), ToolOutcome(None, "Error: malformed tool call: x", "malformed")]
    assert tool_result_messages(outcomes, native=True) == [
        {"role": "tool", "name": "calc", "content": "6"},
        {"role": "tool", "name": "unknown", "content": "Error: malformed tool call: x"}]
    (msg,) = tool_result_messages(outcomes, native=False)
    assert msg == {"role": "user", "content": '<tool_response>\n{"name": "calc", "content": "6"}\n</tool_response>\n'
                   '<tool_response>\n{"name": null, "content": "Error: malformed tool call: x"}\n</tool_response>'}


@pytest.mark.parametrize("template, expected", [
    (SMOLLM2_TEMPLATE, False),
    (TOOLS_TEMPLATE, True),
    (DROP_REASONING_TEMPLATE, False),
    (None, False),
    ("{{ 'tools are nice' }}{% for m in messages %}{{ m['content'] }}{% endfor %}", False),
    ("{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}{{ tools }}", True),
    ("{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}{{ 'tools' }}", False),
    ({"default": SMOLLM2_TEMPLATE, "tool_use": TOOLS_TEMPLATE}, True),
])
def test_template_supports_tools(template, expected):
    tok = build_chat_tokenizer(None)
    tok.chat_template = template
    assert template_supports_tools(tok) is expected
