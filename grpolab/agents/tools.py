"""Tools: plain Python functions the policy may call during an episode.

A tool is a module-level function with type hints and a Google-style docstring ("Args:" section),
e.g.

    def calculator(expression: str) -> str:
        '''Evaluates an arithmetic expression on integers.

        Args:
            expression: e.g. "(12 + 3) * 4"
        '''

Its JSON schema comes from transformers' `get_json_schema` (what chat templates take as `tools=`).
Config: `rollout.tools: ["pkg.mod:fn", ...]` -> `load_tools(specs)`, a `ToolBox` (the tools by name
and the worker process that runs them). `call_tool(box, call)` runs one parsed call and never
raises for the model's mistakes: every failure becomes a `ToolOutcome` whose text goes back to the
model, with its kind (ERROR_KINDS) for the episode's counts:

- "malformed": the call could not be parsed (toolcall.MalformedCall; its reason is shown);
- "unknown_tool": no tool of that name (the known names are listed);
- "bad_arguments": arguments that do not fit the signature or the schema's JSON types;
- "raised": the tool raised; the model sees "ExceptionType: message", never a traceback;
- "timeout": the call ran past the tool's `timeout_s` (wall clock); the worker is killed and
  restarted (toolworker.py explains why a process and not a thread).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

from grpolab.imports import import_object
from grpolab.agents.toolcall import MalformedCall, ParsedCall
from grpolab.agents.toolworker import ToolWorker
from grpolab.errors import ConfigError

ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout")
DEFAULT_TIMEOUT_S = 10.0
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "array": (list,), "object": (dict,), "null": (type(None),)}


@dataclass(frozen=True)
class Tool:
    """One tool: its name (the function's), the function, its JSON schema
    ({"type": "function", "function": {"name", "description", "parameters", ...}}), its time
    limit in seconds (wall clock, per call) and its import spec."""

    name: str
    function: Callable[..., Any]
    schema: dict[str, Any]
    timeout_s: float = DEFAULT_TIMEOUT_S
    spec: str = ""
    """'pkg.mod:fn': how the worker process imports it."""


class ToolOutcome(NamedTuple):
    """One call's result: the tool's name (None when unparsed), the text for the model, the error
    kind (None on success, else one of ERROR_KINDS) and the seconds the call took."""

    name: str | None
    text: str
    error: str | None = None
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


def make_tool(function: Callable[..., Any], timeout_s: float = DEFAULT_TIMEOUT_S, where: str | None = None) -> Tool:
    """A Tool from a function; ConfigError naming `where` (default: the function's name) when it has
    no usable schema (type hints and an "Args:" docstring are needed) or cannot be imported by name
    in the worker process (a lambda, a function defined inside another or in a `__main__` script)."""
    from transformers.utils import get_json_schema

    where = where or f"tool {getattr(function, '__name__', function)!r}"
    if not inspect.isfunction(function):
        raise ConfigError(f"{where}: is a {type(function).__name__}, not a function")
    if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < float("inf")):
        raise ConfigError(f"{where}: timeout_s must be a positive number of seconds, got {timeout_s!r}")
    try:
        schema = get_json_schema(function)
    except Exception as e:  # noqa: BLE001 - transformers' DocstringParsingException, TypeHintParsingException
        raise ConfigError(f"{where}: no JSON schema: {type(e).__name__}: {e} (a tool needs type hints and a "
                          "docstring with an 'Args:' section describing every argument)") from None
    spec = f"{function.__module__}:{function.__qualname__}"
    try:
        importable = function.__module__ != "__main__" and import_object(spec, where) is function
    except ConfigError:
        importable = False
    if not importable:
        raise ConfigError(f"{where}: must be a module-level function of an importable module (tools run in a "
                          f"worker process, which imports them by name), got {spec!r}")
    return Tool(function.__name__, function, schema, float(timeout_s), spec)


class ToolBox:
    """The tools of a run by name, the worker process that runs them, and the cap on a result's text
    (max_result_chars: longer results are cut, with a note, to protect the episode's token budget).
    A context manager; `close()` stops the worker."""

    def __init__(self, tools: Sequence[Tool], max_result_chars: int = 2000):
        self.tools: dict[str, Tool] = {}
        for t in tools:
            if t.name in self.tools:
                raise ConfigError(f"tools: two tools are named {t.name!r}")
            self.tools[t.name] = t
        self.max_result_chars = max_result_chars
        self.worker = ToolWorker({t.name: t.spec for t in tools})

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools' JSON schemas, in order (the chat template's `tools=`)."""
        return [t.schema for t in self.tools.values()]

    def close(self) -> None:
        self.worker.close()

    def __enter__(self) -> "ToolBox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.tools)


def load_tools(specs: Sequence[str | Callable[..., Any]], timeout_s: float | None = None,
               max_result_chars: int = 2000) -> ToolBox:
    """A ToolBox of the tools named by `specs` ('pkg.mod:fn' strings, or functions). Time limit of
    each: `timeout_s` when given, else the function's own `timeout_s` attribute (a tool that needs
    longer declares it, e.g. builtin.run_python), else DEFAULT_TIMEOUT_S. ConfigError naming the spec
    for a missing module or attribute, a non-function, or a function without a usable schema."""
    tools = []
    for spec in specs:
        where = f"tool {spec!r}" if isinstance(spec, str) else None
        fn = import_object(spec, where) if isinstance(spec, str) else spec
        limit = timeout_s if timeout_s is not None else getattr(fn, "timeout_s", DEFAULT_TIMEOUT_S)
        tools.append(make_tool(fn, limit, where))
    return ToolBox(tools, max_result_chars)


def check_arguments(tool: Tool, arguments: dict[str, Any]) -> str | None:
    """Why `arguments` do not fit the tool (its signature, then its schema's JSON types), or None."""
    try:
        inspect.signature(tool.function).bind(**arguments)
    except TypeError as e:
        return str(e)
    props = tool.schema["function"].get("parameters", {}).get("properties", {})
    for key, value in arguments.items():
        expected = props.get(key, {}).get("type")
        if expected is None:
            continue
        names = expected if isinstance(expected, list) else [expected]
        types = tuple(t for n in names for t in _JSON_TYPES.get(n, (object,)))
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            return f"argument {key!r} must be {' or '.join(names)}, got {type(value).__name__} {value!r}"[:300]
        choices = props[key].get("enum")
        if choices is not None and value not in choices:
            return f"argument {key!r} must be one of {choices}, got {value!r}"[:300]
    return None


def call_tool(box: ToolBox, call: ParsedCall | MalformedCall) -> ToolOutcome:
    """Runs one call (see the module docstring for the outcomes). Never raises for the call's content."""
    if isinstance(call, MalformedCall):
        return ToolOutcome(None, f"Error: malformed tool call: {call.reason}", "malformed")
    tool = box.tools.get(call.name)
    if tool is None:
        known = ", ".join(box.tools) or "none"
        return ToolOutcome(call.name, f"Error: unknown tool {call.name!r} (tools: {known})", "unknown_tool")
    problem = check_arguments(tool, call.arguments)
    if problem is not None:
        return ToolOutcome(call.name, f"Error: bad arguments for {call.name}: {problem}", "bad_arguments")
    status, text, wall = box.worker.call(tool.name, call.arguments, tool.timeout_s)
    if status == "timeout":
        return ToolOutcome(call.name, f"Error: {call.name} timed out after {tool.timeout_s:g} s", "timeout", wall)
    if status != "ok":  # "raised", or "died": the tool ended its process (os._exit, a crash)
        verb = "raised" if status == "raised" else "failed:"
        return ToolOutcome(call.name, _cut(f"Error: {call.name} {verb} {text}", box.max_result_chars), "raised", wall)
    return ToolOutcome(call.name, _cut(text, box.max_result_chars), None, wall)


def _cut(text: str, limit: int) -> str:
    """`text`, or its first `limit` characters and a note of how many were cut."""
    return text if len(text) <= limit else text[:limit] + f"\n[... {len(text) - limit} characters cut]"
