"""Tool calls as text: parsing them out of a policy turn, and the default format for templates without tools.

The call format (Hermes / Qwen2.5 style; also what Qwen2.5's own template asks for):

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "4821 * 7390"}}
    </tool_call>

A turn may hold several calls; text around them is free. A block whose JSON is invalid, is not an
object, lacks a string "name" or an object "arguments", or whose tag is never closed is a
`MalformedCall` with the reason (the episode goes on; the model is told).

Where the tools go (`template_supports_tools`):
- the chat template references `tools` (Qwen2.5, Llama 3.1, Hermes, ...): the schemas go to the
  template's `tools=`, results go back as {"role": "tool", "name", "content"} messages
  (`tool_result_messages(outcomes, native=True)`), rendered as the template does;
- otherwise (SmolLM2-135M-Instruct's template has no tools): the DEFAULT FORMAT. `tool_system_prompt`
  lists each tool's JSON schema inside <tools></tools> in the system message (added to the first
  system message, or a new one first) and describes the call format above; results go back as ONE
  user message of <tool_response> blocks, one per call, in call order:

      <tool_response>
      {"name": "calculator", "content": "35627190"}
      </tool_response>

Only the <tool_call> syntax is parsed; models whose native format differs (Llama 3's bare JSON,
Mistral's [TOOL_CALLS]) need a parser of their own.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple, Sequence

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class ParsedCall(NamedTuple):
    """A well-formed call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


class MalformedCall(NamedTuple):
    """A <tool_call> block that is not a valid call: why (for the model), and the block's text."""

    reason: str
    text: str


def parse_tool_calls(text: str) -> list[ParsedCall | MalformedCall]:
    """The calls in a policy turn's text, in order (empty: the turn calls no tool).

    A closing tag without an opening one is ignored; an opening tag without a closing one (before
    the next opening tag or the end) is a MalformedCall("unclosed <tool_call> tag").
    """
    calls: list[ParsedCall | MalformedCall] = []
    pos = text.find(OPEN)
    while pos != -1:
        start = pos + len(OPEN)
        end = text.find(CLOSE, start)
        nxt = text.find(OPEN, start)
        if end == -1 or (nxt != -1 and nxt < end):
            block = text[pos:nxt] if nxt != -1 else text[pos:]
            calls.append(MalformedCall(f"unclosed {OPEN} tag (expected {CLOSE})", block))
            pos = nxt
            continue
        calls.append(_parse_body(text[start:end]))
        pos = text.find(OPEN, end + len(CLOSE))
    return calls


def _parse_body(body: str) -> ParsedCall | MalformedCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return MalformedCall(f"invalid JSON ({e.msg} at character {e.pos})", body)
    if not isinstance(obj, dict):
        return MalformedCall(f"expected a JSON object with \"name\" and \"arguments\", got {type(obj).__name__}", body)
    name, arguments = obj.get("name"), obj.get("arguments")
    if not isinstance(name, str) or not name:
        return MalformedCall("missing \"name\" (a non-empty string)", body)
    if not isinstance(arguments, dict):
        what = "missing" if "arguments" not in obj else f"a {type(arguments).__name__}"
        return MalformedCall(f"\"arguments\" must be a JSON object, got {what}", body)
    return ParsedCall(name, arguments)


_PROMPT_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
_PROMPT_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
    "</tool_call>\nThe results come back within <tool_response></tool_response> XML tags."
)


def tool_system_prompt(schemas: Sequence[dict[str, Any]]) -> str:
    """The default format's system text: each tool's JSON schema (one per line) and the call format."""
    return _PROMPT_HEAD + "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas) + _PROMPT_TAIL


def with_tool_prompt(messages: Sequence[dict[str, Any]], schemas: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with `tool_system_prompt(schemas)` appended to the first system message (after a
    blank line), or put first as a system message when there is none. The input is not modified."""
    out = [dict(m) for m in messages]
    prompt = tool_system_prompt(schemas)
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def tool_result_messages(outcomes: Sequence[Any], native: bool) -> list[dict[str, Any]]:
    """The messages that carry tool outcomes (tools.ToolOutcome: .name, .text) back to the model:
    one "tool" message per outcome when the template has tools (native), else one user message
    of <tool_response> blocks (the default format)."""
    if native:
        return [{"role": "tool", "name": o.name or "unknown", "content": o.text} for o in outcomes]
    bodies = [json.dumps({"name": o.name, "content": o.text}, ensure_ascii=False) for o in outcomes]
    blocks = [f"<tool_response>\n{body}\n</tool_response>" for body in bodies]
    return [{"role": "user", "content": "\n".join(blocks)}]


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template reads a `tools` variable (False without a template).

    The template is parsed with jinja2 and its free variables are read, so "tools" written inside
    a string literal does not count; a template jinja2 cannot parse on its own (custom tags) is
    searched for the word `tools` outside quotes. A dict of named templates counts when any does.
    """
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return any(_reads_tools(t) for t in template.values() if isinstance(t, str))
    return isinstance(template, str) and _reads_tools(template)


def _reads_tools(template: str) -> bool:
    import jinja2
    from jinja2 import meta

    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        code = " ".join(re.findall(r"{[{%](.*?)[}%]}", template, flags=re.S))
        code = re.sub(r"'[^']*'|\"[^\"]*\"", "''", code)
        return re.search(r"\btools\b", code) is not None
    return "tools" in meta.find_undeclared_variables(ast)
