"""The process that runs tool functions, so that a tool's time limit is enforced for real.

Why a process and not a thread: a Python thread cannot be stopped. A daemon thread with
`join(timeout)` returns on time, but a tool stuck in a busy loop or a blocking call keeps running
(and takes the GIL part of the time) for the rest of the run, and every further timeout leaks one
more such thread. A child process can be killed: on a timeout the worker is SIGKILLed, whatever it
was doing goes with it (the worker leads its own process group, which is killed whole, so processes
a tool started go too), and a fresh worker starts at the next call. An idle worker exits when its
stdin closes, i.e. when the training process ends.

How: `python -m grpolab.agents.toolworker`, talking JSON lines over its stdin and stdout. The
tools are named by 'pkg.mod:fn' and imported in the child (with the parent's sys.path), arguments
are JSON (they come from the model's JSON anyway) and results come back as text. No pickling and
no fork: unlike multiprocessing's "spawn" it never re-imports the parent's main script (which
re-runs an unguarded training script), and unlike "fork" it is safe in a process holding CUDA
state or torch's thread pools. A tool's own prints go to stderr. Costs: one pipe round trip per
call (well under a millisecond) and a start (~0.1-1 s: the interpreter and the tools' modules)
at the first call and after each timeout; start-up never counts against a call's limit.

Model-written code needs more than a process (another uid, resource limits, no network): see
`builtin.run_python`, which runs it in sandbox/sandbox.py.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any


class ToolWorker:
    """One child process that runs the tools `specs` (name -> 'pkg.mod:fn') by name, one call at a
    time (thread-safe). startup_timeout_s: the most a (re)start may take."""

    def __init__(self, specs: dict[str, str], startup_timeout_s: float = 60.0):
        self.specs = dict(specs)
        self.startup_timeout_s = startup_timeout_s
        self.restarts = 0
        """How many times a worker was killed (a timeout, or it died) and replaced at the next call."""
        self._proc: subprocess.Popen | None = None
        self._buffer = b""
        self._lock = threading.Lock()

    def call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> tuple[str, str, float]:
        """Runs the tool `name` with keyword `arguments`, waiting at most `timeout_s` seconds.

        Returns (status, text, wall_s): status "ok" (text: the result as text), "raised" (text:
        "ExceptionType: message", no traceback), "timeout" (the worker was killed; text empty) or
        "died" (the worker exited during the call; text says with which code). wall_s: seconds waited.
        """
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            t0 = time.monotonic()
            try:
                self._send({"name": name, "arguments": arguments})
                reply = self._receive(t0 + timeout_s)
            except (BrokenPipeError, EOFError):
                code = self._exit_code()
                self._kill()
                return "died", f"the tool process exited (code {code})", time.monotonic() - t0
            if reply is None:
                self._kill()
                return "timeout", "", time.monotonic() - t0
            return reply["status"], reply["text"], time.monotonic() - t0

    def close(self) -> None:
        """Stops the worker (a later call starts a new one)."""
        with self._lock:
            self._kill(count=False)

    def _start(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # finds grpolab as we do
        self._proc = subprocess.Popen([sys.executable, "-m", "grpolab.agents.toolworker"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, bufsize=0, env=env, start_new_session=True)
        self._buffer = b""
        try:
            self._send({"sys_path": sys.path, "tools": self.specs})
            reply = self._receive(time.monotonic() + self.startup_timeout_s)
        except (BrokenPipeError, EOFError):
            reply = {"status": "error", "text": f"it exited (code {self._exit_code()})"}
        if reply is None or reply["status"] != "ready":
            self._kill(count=False)
            why = reply["text"] if reply else f"no answer within {self.startup_timeout_s:g} s"
            raise RuntimeError(f"the tool worker did not start: {why}")

    def _send(self, message: dict[str, Any]) -> None:
        self._proc.stdin.write(json.dumps(message).encode() + b"\n")

    def _receive(self, deadline: float) -> dict[str, Any] | None:
        """The next JSON line from the worker; None at the deadline; EOFError when it exited."""
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise EOFError
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def _exit_code(self) -> int | None:
        """The worker's exit status once its pipe closed (None if it has not exited within a second)."""
        try:
            return self._proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return None

    def _kill(self, count: bool = True) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            try:  # its own process group: whatever the tool started goes too (not yet reaped: the id is ours)
                os.killpg(self._proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self._proc.kill()
        self._proc.wait()
        for stream in (self._proc.stdin, self._proc.stdout):
            stream.close()
        self._proc = None
        self.restarts += count

    def __del__(self):
        try:
            self._kill(count=False)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _text(result: Any) -> str:
    """A tool's return value as text for the model: a str as is, anything else as JSON (str() fallback)."""
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(result)


def _serve() -> None:
    """The worker's loop (this module run as a script): imports the tools, then answers calls."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a tool's prints must not reach the protocol stream
    sys.stdout = sys.stderr

    def reply(status: str, text: str) -> None:
        out.write(json.dumps({"status": status, "text": text}) + "\n")
        out.flush()

    setup = json.loads(sys.stdin.readline())
    sys.path[:] = setup["sys_path"]
    try:
        from grpolab.imports import import_object

        functions = {name: import_object(spec, f"tool {spec!r}") for name, spec in setup["tools"].items()}
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises
        return reply("error", f"{type(e).__name__}: {e}")
    reply("ready", "")
    for line in sys.stdin:
        call = json.loads(line)
        try:
            reply("ok", _text(functions[call["name"]](**call["arguments"])))
        except (Exception, SystemExit) as e:  # noqa: BLE001 - a tool may raise anything
            reply("raised", f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    _serve()
