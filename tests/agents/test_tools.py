"""grpolab.agents.tools: loading tools, schemas, and every outcome of a call (time limits for real)."""

import os
import time

import pytest

import agents_fixtures
from grpolab.agents.toolcall import MalformedCall, ParsedCall
from grpolab.agents.tools import ERROR_KINDS, ToolBox, call_tool, load_tools, make_tool
from grpolab.errors import ConfigError

LIMIT_S = 0.5


@pytest.fixture(scope="module")
def box():
    """add, shout, boom, sleep_forever, spin, crash, quit_tool; each with a 0.5 s limit; one worker."""
    specs = [f"agents_fixtures:{n}" for n in ("add", "shout", "boom", "sleep_forever", "spin", "crash", "quit_tool")]
    with load_tools(specs, timeout_s=LIMIT_S, max_result_chars=200) as b:
        yield b


def test_load_tools_builds_schemas_from_type_hints_and_docstrings(box):
    assert list(box.tools) == ["add", "shout", "boom", "sleep_forever", "spin", "crash", "quit_tool"]
    fn = box.schemas[0]["function"]
    assert fn["name"] == "add" and fn["description"] == "Adds two integers."
    assert fn["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first."}
    assert fn["parameters"]["required"] == ["a", "b"]
    assert box.tools["add"].timeout_s == LIMIT_S


def test_load_tools_accepts_functions_and_their_own_time_limit():
    from grpolab.agents.builtin import run_python

    b = load_tools([agents_fixtures.add, "grpolab.agents.builtin:run_python"])
    assert b.tools["add"].timeout_s == 10.0 and b.tools["run_python"].timeout_s == run_python.timeout_s
    b.close()


@pytest.mark.parametrize("spec, message", [
    ("no_such_tools_mod:f", "tool 'no_such_tools_mod:f': no module named 'no_such_tools_mod'"),
    ("agents_fixtures:nope", "tool 'agents_fixtures:nope': module 'agents_fixtures' has no attribute 'nope'"),
    ("agents_fixtures:no_docs", "tool 'agents_fixtures:no_docs': no JSON schema"),
    ("agents_fixtures:EchoEnv", "tool 'agents_fixtures:EchoEnv': is a type, not a function"),
])
def test_load_tools_errors_name_the_spec(spec, message):
    with pytest.raises(ConfigError, match=message):
        load_tools([spec])


def test_a_local_function_is_refused():
    def local(a: int) -> int:
        """Local.

        Args:
            a: A.
        """
        return a

    with pytest.raises(ConfigError, match="must be a module-level function"):
        make_tool(local)


def test_two_tools_with_one_name_are_refused():
    t = make_tool(agents_fixtures.add)
    with pytest.raises(ConfigError, match="two tools are named 'add'"):
        ToolBox([t, t])


def test_call_ok(box):
    out = call_tool(box, ParsedCall("add", {"a": 2, "b": 3}))
    assert out.ok and out.text == "5" and out.name == "add" and out.error is None
    out = call_tool(box, ParsedCall("shout", {"text": "hi"}))
    assert out.ok and out.text == '{"shout": "HI"}'


def test_a_long_result_is_cut(box):
    out = call_tool(box, ParsedCall("shout", {"text": "ab", "times": 200}))  # 413 characters of JSON
    assert out.ok and out.text == '{"shout": "' + "AB" * 94 + "A\n[... 213 characters cut]"


def test_malformed_and_unknown_tool(box):
    out = call_tool(box, MalformedCall("invalid JSON (x)", "{"))
    assert out.error == "malformed" and out.text == "Error: malformed tool call: invalid JSON (x)"
    out = call_tool(box, ParsedCall("mul", {"a": 1}))
    assert out.error == "unknown_tool" and "unknown tool 'mul'" in out.text and "add, shout" in out.text


@pytest.mark.parametrize("arguments, message", [
    ({"a": 1}, "missing a required argument: 'b'"),
    ({"a": 1, "b": 2, "c": 3}, "unexpected keyword argument 'c'"),
    ({"a": "1", "b": 2}, "argument 'a' must be integer, got str '1'"),
    ({"a": True, "b": 2}, "argument 'a' must be integer, got bool True"),
    ({"a": 1.5, "b": 2}, "argument 'a' must be integer, got float 1.5"),
])
def test_bad_arguments(box, arguments, message):
    out = call_tool(box, ParsedCall("add", arguments))
    assert out.error == "bad_arguments" and message in out.text and out.text.startswith("Error: bad arguments for add")


def test_a_raising_tool_reports_type_and_message_without_traceback(box):
    out = call_tool(box, ParsedCall("boom", {"text": "x"}))
    assert out.error == "raised"
    assert out.text == "Error: boom raised ValueError: cannot handle 'x'"
    assert "Traceback" not in out.text


@pytest.mark.parametrize("name", ["sleep_forever", "spin"])
def test_a_hanging_tool_times_out_and_the_next_call_works(box, name):
    restarts = box.worker.restarts
    t0 = time.monotonic()
    out = call_tool(box, ParsedCall(name, {"seconds": 1.0}))
    elapsed = time.monotonic() - t0
    assert out.error == "timeout" and out.text == f"Error: {name} timed out after {LIMIT_S:g} s"
    assert LIMIT_S <= elapsed < 2 * LIMIT_S
    assert box.worker.restarts == restarts + 1
    assert call_tool(box, ParsedCall("add", {"a": 1, "b": 1})).text == "2"  # a fresh worker


def test_a_tool_that_ends_its_process_is_an_error_and_the_next_call_works(box):
    out = call_tool(box, ParsedCall("crash", {"code": 3}))
    assert out.error == "raised" and "exited (code 3)" in out.text
    out = call_tool(box, ParsedCall("quit_tool", {"code": 4}))
    assert out.error == "raised" and out.text == "Error: quit_tool raised SystemExit: 4"
    assert call_tool(box, ParsedCall("add", {"a": 2, "b": 2})).text == "4"


def test_a_tool_that_prints_does_not_disturb_the_protocol(capfd):
    with load_tools(["agents_fixtures:chatty"]) as b:
        assert call_tool(b, ParsedCall("chatty", {"text": "hello"})).text == "done"
    assert "hello" in capfd.readouterr().err  # the tool's stdout went to stderr


def test_the_worker_is_a_separate_process_and_stops_on_close():
    with load_tools(["agents_fixtures:add"]) as b:
        assert call_tool(b, ParsedCall("add", {"a": 1, "b": 2})).text == "3"
        proc = b.worker._proc
        assert proc.pid != os.getpid() and proc.poll() is None
    assert proc.poll() is not None and b.worker._proc is None


def test_error_kinds_are_the_documented_ones():
    assert ERROR_KINDS == ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout")


def _sandbox_works() -> bool:
    from grpolab.sandbox.sandbox import SandboxUnavailable, sandbox_info

    try:
        sandbox_info()
        return True
    except SandboxUnavailable:
        return False


@pytest.mark.skipif(os.geteuid() != 0 or not _sandbox_works(), reason="the code sandbox needs root")
def test_run_python_runs_in_the_sandbox():
    with load_tools(["grpolab.agents.builtin:run_python"]) as b:
        out = call_tool(b, ParsedCall("run_python", {"code": "import os; print(6 * 7, os.getuid() != 0)"}))
        assert out.ok and out.text == "42 True\n"
        out = call_tool(b, ParsedCall("run_python", {"code": "1/0"}))
        assert out.ok and "ZeroDivisionError" in out.text and "[exit code 1" in out.text
