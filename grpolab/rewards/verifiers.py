"""Verifier rewards for real tasks: answer extraction, reasoning-gym's own scorers, math-verify.

- `reasoning_gym`: the task's `score_answer(answer, entry)` on the extracted answer (default: the
  last number). reasoning-gym gives partial credit (e.g. 0.01 for a wrong non-empty answer): only
  a full 1.0 counts, so the reward is 1.0 / 0.0. Rows without `rg_entry` in meta: None.
- `math_verify`: `verify(parse(gold), parse(completion))` with gold = meta["answer"] (wrapped in
  `$...$` when it is plain text). Rows without an answer: None. It runs in a child process with a
  per-row wall-clock limit: a slow or hostile answer scores 0.0 and the child is restarted.
- `answer_format`: 1.0 if an answer can be extracted in the configured mode, else 0.0.

Like the rule rewards, a completion whose meta says `truncated` scores 0.0.

Extraction modes (`extract_answer(text, mode)`): "boxed" (the last \\boxed{...}), "answer_colon"
(the last "Answer: X" line), "last_number" (the last number, thousands commas removed), "auto"
(boxed, else answer_colon, else last_number) and "strip" (the whole text, stripped).
"""

from __future__ import annotations

import json
import logging
import queue
import re
import subprocess
import sys
import threading
import weakref
from typing import Any, Callable, Sequence

from grpolab.optional import require

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- extraction

_ANSWER_COLON = re.compile(r"\banswer\s*\**\s*[:：]\s*([^\n]*)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")


def extract_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{...}` (nested braces allowed), stripped; else None."""
    start = text.rfind("\\boxed")
    while start != -1:
        i = start + len("\\boxed")
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return text[i + 1 : j].strip() or None
        start = text.rfind("\\boxed", 0, start)
    return None


def extract_answer_colon(text: str) -> str | None:
    """What follows the last "Answer:" (any case, markdown bold allowed) on its line; else None."""
    matches = _ANSWER_COLON.findall(text)
    if not matches:
        return None
    ans = matches[-1].strip().strip("*").strip()
    ans = ans[:-1].rstrip() if ans.endswith(".") else ans
    return ans or None


def extract_last_number(text: str) -> str | None:
    """The last number in the text ("-12", "3.5", "1,234" -> "1234"); else None."""
    matches = _NUMBER.findall(text)
    return matches[-1].replace(",", "") if matches else None


def _strip(text: str) -> str | None:
    return text.strip() or None


def _auto(text: str) -> str | None:
    for fn in (extract_boxed, extract_answer_colon, extract_last_number):
        ans = fn(text)
        if ans is not None:
            return ans
    return None


EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "boxed": extract_boxed,
    "answer_colon": extract_answer_colon,
    "last_number": extract_last_number,
    "auto": _auto,
    "strip": _strip,
}


def check_mode(mode: str, field: str = "extract") -> str:
    if mode not in EXTRACTORS:
        raise ValueError(f"{field}: unknown answer extraction mode {mode!r}; known: {', '.join(EXTRACTORS)}")
    return mode


def extract_answer(text: str, mode: str = "auto") -> str | None:
    """The answer in a completion by `mode` (see the module docstring), or None if there is none."""
    return EXTRACTORS[check_mode(mode, "mode")](text)


def _check_lengths(name: str, completions: Sequence[str], metadata: Sequence[dict[str, Any]]) -> None:
    if len(metadata) != len(completions):
        raise ValueError(f"reward {name!r}: {len(completions)} completions but {len(metadata)} metadata rows")


# --------------------------------------------------------------------------- answer_format


class AnswerFormat:
    """1.0 when an answer can be extracted in `extract` mode (and not truncated), else 0.0."""

    name = "answer_format"
    verifier = False

    def __init__(self, extract: str = "boxed"):
        self.extract = check_mode(extract)

    def __call__(self, prompts: Sequence[str], completions: Sequence[str],
                 metadata: Sequence[dict[str, Any]]) -> list[float | None]:
        _check_lengths(self.name, completions, metadata)
        return [float(not m.get("truncated", False) and extract_answer(c, self.extract) is not None)
                for c, m in zip(completions, metadata, strict=True)]


# --------------------------------------------------------------------------- reasoning_gym


class ReasoningGymReward:
    """1.0 iff the task's own `score_answer` gives the extracted answer a full 1.0, else 0.0.

    meta needs "rg_task" and "rg_entry" (as `grpolab.data.sources.reasoning_gym_items` writes
    them; "rg_params" rebuilds the task's config); rows without them get None.
    """

    name = "reasoning_gym"
    verifier = True

    def __init__(self, extract: str = "last_number"):
        self.extract = check_mode(extract)
        self._rg = require("reasoning_gym", "tasks")
        self._scorers: dict[str, Callable[[str | None, dict], float]] = {}

    def _scorer(self, task: str, params: dict[str, Any]) -> Callable[[str | None, dict], float]:
        key = json.dumps([task, params], sort_keys=True, default=repr)
        if key not in self._scorers:
            self._scorers[key] = self._rg.create_dataset(task, size=1, seed=0, **params).score_answer
        return self._scorers[key]

    def __call__(self, prompts: Sequence[str], completions: Sequence[str],
                 metadata: Sequence[dict[str, Any]]) -> list[float | None]:
        _check_lengths(self.name, completions, metadata)
        out: list[float | None] = []
        for i, (text, meta) in enumerate(zip(completions, metadata, strict=True)):
            if "rg_entry" not in meta or "rg_task" not in meta:
                out.append(None)
                continue
            if meta.get("truncated", False):
                out.append(0.0)
                continue
            score = self._scorer(meta["rg_task"], meta.get("rg_params", {}))
            answer = extract_answer(text, self.extract)
            try:
                value = float(score(answer, meta["rg_entry"]))
            except Exception as e:  # a task's scorer choking on a strange answer is a wrong answer
                log.warning("reasoning_gym %s: score_answer failed on row %d (%r): %s", meta["rg_task"], i, answer, e)
                value = 0.0
            out.append(1.0 if value >= 1.0 else 0.0)
        return out


# --------------------------------------------------------------------------- math_verify

# The child process: reads one JSON job per line, answers one JSON line per job. It imports only
# math_verify (not torch, not grpolab), caps its own memory, keeps stdout for the protocol only,
# and runs math-verify with its signal-based timeouts disabled (the parent enforces wall-clock).
_WORKER_CODE = r"""
import json, logging, os, sys
out = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1); sys.stdout = sys.stderr
limit_mb = int(sys.argv[1])
if limit_mb > 0:
    try:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (limit_mb << 20, resource.getrlimit(resource.RLIMIT_AS)[1]))
    except (ImportError, ValueError, OSError):
        pass
logging.getLogger("math_verify").setLevel(logging.ERROR)
from math_verify import parse, verify
out.write('{"ready": true}\n')
for line in sys.stdin:
    job = json.loads(line)
    try:
        gold = parse(job["gold"], parsing_timeout=None)
        pred = parse(job["pred"], parsing_timeout=None)
        value = bool(verify(gold, pred, timeout_seconds=None))
    except (Exception, RecursionError, MemoryError):
        value = False
    out.write(json.dumps({"id": job["id"], "value": value}) + "\n")
"""


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    try:
        proc.stdin.close()  # stdout is closed by the reader thread at EOF
    except OSError:  # broken pipe while flushing
        pass


class MathVerifyWorker:
    """One child Python process running math-verify, restarted when a job overruns its time.

    `check(gold, pred, timeout_s)` -> True / False, or None when the job timed out or the child
    died (the child is then killed; the next call starts a fresh one).
    """

    def __init__(self, memory_limit_mb: int = 4096, startup_timeout_s: float = 120.0):
        self.memory_limit_mb = memory_limit_mb
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen | None = None
        self._replies: queue.Queue = queue.Queue()
        self._finalizer: weakref.finalize | None = None
        self._next_id = 0
        self.restarts = 0

    def _start(self) -> None:
        proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_CODE, str(self.memory_limit_mb)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
        )
        replies: queue.Queue = queue.Queue()  # a fresh queue: a killed child's late reply is never read

        def pump() -> None:
            try:
                for line in proc.stdout:
                    replies.put(line)
            finally:
                replies.put(None)  # EOF: the child is gone
                proc.stdout.close()

        threading.Thread(target=pump, daemon=True).start()
        self._proc, self._replies = proc, replies
        self._finalizer = weakref.finalize(self, _kill, proc)
        try:
            first = replies.get(timeout=self.startup_timeout_s)
        except queue.Empty:
            first = None
        if first is None or not json.loads(first).get("ready"):
            self.close()
            raise RuntimeError("math_verify: the verifier process did not start (is math-verify installed?)")

    def check(self, gold: str, pred: str, timeout_s: float) -> bool | None:
        if self._proc is None or self._proc.poll() is not None:
            self.close()
            self._start()
        self._next_id += 1
        job_id = self._next_id
        try:
            self._proc.stdin.write(json.dumps({"id": job_id, "gold": gold, "pred": pred}) + "\n")
            self._proc.stdin.flush()
            while True:
                line = self._replies.get(timeout=timeout_s)
                if line is None:
                    break
                reply = json.loads(line)
                if reply.get("id") == job_id:
                    return bool(reply["value"])
        except (queue.Empty, OSError, ValueError):
            pass
        self.close()
        self.restarts += 1
        return None

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # kills and reaps the child once
        self._proc, self._finalizer = None, None


def gold_latex(gold: Any) -> str:
    """A gold answer for math-verify's parser: plain text is wrapped in $...$."""
    s = str(gold).strip()
    return s if ("$" in s or "\\boxed" in s) else f"${s}$"


class MathVerifyReward:
    """1.0 if math-verify finds the completion's answer equal to meta[answer_field], else 0.0.

    timeout_s: wall-clock limit per row (parse + verify); over it the row scores 0.0 and the
    verifier process is restarted. extract: None = hand math-verify the whole completion (it
    finds \\boxed / LaTeX / the last expression itself), or an extraction mode applied first.
    memory_limit_mb: address-space cap of the verifier process (0 = none).
    """

    name = "math_verify"
    verifier = True

    def __init__(self, timeout_s: float = 2.0, extract: str | None = None, answer_field: str = "answer",
                 memory_limit_mb: int = 4096):
        require("math_verify", "tasks")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0 seconds, got {timeout_s}")
        self.row_timeout_s = timeout_s  # not `timeout_s`: that is the whole call's limit (base.score_batch)
        self.extract = None if extract is None else check_mode(extract)
        self.answer_field = answer_field
        self.worker = MathVerifyWorker(memory_limit_mb=memory_limit_mb)
        self._lock = threading.Lock()

    def __call__(self, prompts: Sequence[str], completions: Sequence[str],
                 metadata: Sequence[dict[str, Any]]) -> list[float | None]:
        _check_lengths(self.name, completions, metadata)
        out: list[float | None] = []
        with self._lock:
            for text, meta in zip(completions, metadata, strict=True):
                gold = meta.get(self.answer_field)
                if gold is None:
                    out.append(None)
                    continue
                pred = text if self.extract is None else extract_answer(text, self.extract)
                if meta.get("truncated", False) or not pred or not pred.strip():
                    out.append(0.0)
                    continue
                ok = self.worker.check(gold_latex(gold), pred, self.row_timeout_s)
                out.append(1.0 if ok else 0.0)
        return out

    def close(self) -> None:
        """Stops the verifier process (a later call starts a new one)."""
        with self._lock:
            self.worker.close()
