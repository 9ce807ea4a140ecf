"""Runs untrusted (model-written) Python code in a throwaway, resource-limited process.

`run_sandboxed(code)` writes the code to a fresh `tempfile.mkdtemp()` directory, runs it with
`python -I` (isolated mode: no PYTHONPATH, no user site-packages, no script dir on sys.path) and
returns a `SandboxResult`; the directory is deleted afterwards (in namespace mode the code runs from
a copy in its private tmpfs, below). What contains the code:

- **An unprivileged user.** Each run gets a random uid (= gid) that owns nothing, from
  SANDBOX_UIDS (65,536 ids in 0x70000000.., a range systemd leaves unused), with no supplementary
  groups and no_new_privs: it cannot write the run's files (root's, not world-writable) nor signal
  the training process; it owns only its working directory (cwd, HOME and TMPDIR). A uid of its
  own also gives each run its own RLIMIT_NPROC count: a fork bomb in one run cannot starve a
  concurrent one. Where those ids cannot be used (a user namespace that does not map them), every
  run uses 65534 ("nobody").
- **A clean environment**, rebuilt from scratch: none of the parent's variables (API keys, HOME,
  PYTHONPATH) reach the child.
- **Kernel resource limits**, set before the model's code runs, which it cannot raise:
  RLIMIT_AS (memory_mb), RLIMIT_CPU (cpu_s), RLIMIT_NPROC (max_procs: fork bombs; enforced because
  the uid is not root), RLIMIT_FSIZE (file_size_mb: each file, and the captured output),
  RLIMIT_NOFILE, RLIMIT_CORE = 0.
- **A wall-clock timeout**, after which all the run's processes are SIGKILLed. Should the training
  process die mid-run, an alarm inside the sandbox ends it one second after its deadline
  (namespace mode: the whole namespace; setuid mode: the main process, and the code may cancel it).
- **Bounded output.** stdout/stderr go to unlinked temporary files capped by RLIMIT_FSIZE; the
  result keeps at most `max_output_bytes` of each (head and tail). stdin is an unlinked file open
  read-only.

Two isolation modes; both need root, to switch uid. Without root `run_sandboxed` raises
SandboxUnavailable rather than run model code as the training user.

- `"namespace"` (preferred; used when `unshare` from util-linux works and mounts can be made):
  `unshare --net --pid --ipc --mount-proc` gives the child an empty network namespace (no interface
  is up, not even loopback: every connect fails), its own PID namespace with its own /proc (only
  the run's processes are visible: not the parent, not other processes' command lines), its own
  IPC namespace (SysV shared memory and message queues die with it) and a private mount namespace,
  in which setup.py, as root, before switching to the sandbox uid:
  makes every mount of the host read-only (nothing of the host's file system is writable, whatever
  its permissions) and mounts a tmpfs of `disk_quota_mb` (default 64 MB; inodes capped too) over
  /tmp, holding the run directory (/tmp/grpolab-sandbox-XXX, its cwd work/ in it) and bind-mounted
  over /var/tmp and /dev/shm. That tmpfs is the run's total disk quota (a write past it fails with
  ENOSPC and the result's reason says "disk quota of N MB exceeded"); the host's /tmp is hidden,
  and the tmpfs, files and all, is gone with the namespace at the end of the run. After the run the
  namespace's processes are killed, including any that left the process group with setsid. Its
  PID 1 is a bare supervisor (PID 1 ignores unhandled signals, RLIMIT_CPU's among them); the code
  runs in its child, so its exit status 128 + N is reported as "killed by signal N".
- `"setuid"` (fallback, e.g. a container without CAP_SYS_ADMIN, or where mounts are refused): the
  same user and limits, but much is NOT contained (NOT_CONTAINED["setuid"], also in
  `sandbox_info()["not_contained"]`; "auto" logs a warning when it falls back to it): the network
  is blocked in-process only (the socket module raises; code that goes around it, or a subprocess
  such as curl, can still connect); there is no disk quota (disk_quota_mb is not enforced) and no
  private /tmp: the host's world-writable directories (/tmp, /var/tmp, /dev/shm) are writable, up
  to file_size_mb per file, and files left there outlive the run; /proc is the host's (other
  processes' command lines are readable); SysV IPC objects outlive the run. Leftover processes are
  found after the run by uid and a per-run environment token and killed; their zombies go to PID 1
  (or to this process when it is PID 1 of a container, which then reaps them). Pass
  isolation="namespace" to refuse (SandboxUnavailable) rather than fall back.

Not contained in either mode: world-readable files of the host are readable (read-only in
namespace mode).

The interpreter: sys.executable when the sandbox uid can run it, else the system `python3` (e.g.
a pyenv Python under /root, which others cannot enter); set GRPOLAB_SANDBOX_PYTHON or pass
`python=` to choose. `sandbox_info()` says what was picked. Model code that needs packages must
find them in that interpreter's site-packages.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import IO

from grpolab.sandbox.procs import ACTIVE, ACTIVE_LOCK, TOKEN_VAR, kill_namespace, kill_tagged, reap_orphans, wait_unreaped

log = logging.getLogger(__name__)

SANDBOX_UIDS = range(0x70000000, 0x70000000 + 0x10000)  # one random uid (= gid) per run
FALLBACK_UIDS = range(65534, 65535)  # "nobody", where SANDBOX_UIDS are not mapped
MODES = ("namespace", "setuid")
_PATH = "/usr/local/bin:/usr/bin:/bin"
_SIGNALS = {int(s) for s in signal.Signals}
_SETUP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "setup.py")
NOT_CONTAINED = {
    "namespace": (),
    "setuid": (
        ("network: blocked in-process only (the socket module); code that goes around it, or a "
         "subprocess such as curl, can still connect"),
        ("disk: no total quota (disk_quota_mb is not enforced) and no private temporary directory: "
         "world-writable directories of the host (/tmp, /var/tmp, /dev/shm, ...) are writable, up to "
         "file_size_mb per file, and what is left there outlives the run"),
        "/proc: the host's, so other processes and their command lines are visible",
        "SysV IPC: shared memory segments and message queues outlive the run",
    ),
}
"""What each isolation mode leaves uncontained (also in sandbox_info()["not_contained"])."""

# Runs inside the sandbox, already as the sandbox uid: sets the limits, then runs the code.
_RUNNER = r'''
import json, os, resource, sys

def _block_network():
    import socket, _socket
    def refuse(*args, **kwargs):
        raise PermissionError(1, "network access is disabled in the sandbox")
    for mod in (socket, _socket):
        for name in ("socket", "SocketType", "socketpair", "fromfd", "create_connection", "create_server"):
            if hasattr(mod, name):
                setattr(mod, name, refuse)

def main():
    cfg = json.loads(sys.argv[1])
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    except Exception:
        pass
    if cfg["block_network"]:
        _block_network()
    for name, (soft, hard) in cfg["limits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    if os.getpid() == 1:
        # PID 1 of a namespace ignores the signals it has no handler for, RLIMIT_CPU's SIGKILL
        # included: stay a bare supervisor (reaping orphans) and run the code in a child.
        child = os.fork()
        if child:
            import signal  # a backstop should the parent die: end the namespace at the deadline
            signal.signal(signal.SIGALRM, lambda *_: os._exit(128 + signal.SIGALRM))
            signal.alarm(cfg["deadline_s"])
            while True:
                pid, status = os.wait()
                if pid == child:
                    code = os.waitstatus_to_exitcode(status)
                    os._exit(code if code >= 0 else 128 - code)
    import signal  # a backstop should the parent die (the code may cancel it)
    signal.alarm(cfg["deadline_s"])
    sys.argv[:] = [cfg["program"]]
    import runpy
    runpy.run_path(cfg["program"], run_name="__main__")

main()
'''


class SandboxUnavailable(RuntimeError):
    """No way to run untrusted code safely here (not root, or no interpreter the sandbox uid can run)."""


@dataclass(frozen=True)
class SandboxResult:
    """What one sandboxed run did.

    returncode: the exit status; negative = killed by that signal (as in subprocess); -9 after a
        timeout. In namespace mode an exit status 128 + N is read as "killed by signal N".
    timed_out: the wall-clock timeout fired and the sandbox's processes were killed.
    stdout, stderr: decoded output, at most `max_output_bytes` each (head and tail when cut).
    truncated: some output was cut. wall_s: seconds from start to exit. reason: a short summary
    ("ok", "timed out after 2 s", "killed by SIGKILL", "exit code 1: MemoryError").
    """

    returncode: int
    timed_out: bool
    stdout: str
    stderr: str
    truncated: bool
    wall_s: float
    reason: str

    @property
    def passed(self) -> bool:
        """Exited with status 0 within the limits."""
        return self.returncode == 0 and not self.timed_out


@dataclass(frozen=True)
class _Launcher:
    mode: str  # one of MODES
    python: str  # absolute path of the sandbox interpreter
    unshare: str | None  # absolute path of unshare (namespace mode)
    uids: range  # each run draws its uid (= gid) from here


def run_sandboxed(
    code: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    cpu_s: float | None = None,
    max_procs: int = 32,
    stdin: str | bytes | None = None,
    file_size_mb: int = 16,
    disk_quota_mb: int = 64,
    max_output_bytes: int = 64 * 1024,
    isolation: str = "auto",
    python: str | None = None,
) -> SandboxResult:
    """Runs Python source `code` in a fresh sandbox process (see the module docstring).

    timeout_s: wall clock, startup included. memory_mb: address-space limit. cpu_s: CPU seconds per
    process (default: the timeout rounded up, plus 1). max_procs: processes and threads of the run
    at once. stdin: fed to the program (default: empty). file_size_mb: the largest file (and captured
    output stream). disk_quota_mb: all files together, in the run's private tmpfs (namespace mode
    only; the result's reason says "disk quota of N MB exceeded" when the code ran out). isolation:
    "auto" (namespace if it works, else setuid, with a logged warning), "namespace" (refuses rather
    than fall back) or "setuid". python: the sandbox interpreter (default: see module doc).
    Raises ValueError for a bad argument, SandboxUnavailable when code cannot be run safely here.
    """
    check_limits(timeout_s=timeout_s, memory_mb=memory_mb, cpu_s=cpu_s, max_procs=max_procs,
                file_size_mb=file_size_mb, disk_quota_mb=disk_quota_mb, max_output_bytes=max_output_bytes)
    if not isinstance(code, str):
        raise ValueError(f"run_sandboxed: code must be a str, got {type(code).__name__}")
    launcher = _resolve(isolation, python)
    cpu = math.ceil(timeout_s) + 1 if cpu_s is None else max(1, math.ceil(cpu_s))
    fsize = file_size_mb * 2**20
    limits = {
        "RLIMIT_AS": (memory_mb * 2**20,) * 2,
        "RLIMIT_CPU": (cpu, cpu + 1),  # soft: SIGXCPU; hard: SIGKILL
        "RLIMIT_NPROC": (max_procs,) * 2,
        "RLIMIT_FSIZE": (fsize,) * 2,
        "RLIMIT_NOFILE": (64, 64),
        "RLIMIT_CORE": (0, 0),
    }
    data = stdin.encode() if isinstance(stdin, str) else stdin
    return _run(launcher, code, limits, timeout_s, data, max_output_bytes, disk_quota_mb)


def sandbox_info(isolation: str = "auto", python: str | None = None) -> dict[str, object]:
    """The isolation mode, interpreter and uid range `run_sandboxed` would use (SandboxUnavailable if
    none); disk_quota: whether disk_quota_mb is enforced; not_contained: what the mode leaves open
    (empty in namespace mode; see NOT_CONTAINED)."""
    launcher = _resolve(isolation, python)
    return {"mode": launcher.mode, "python": launcher.python, "uids": launcher.uids,
            "disk_quota": launcher.mode == "namespace", "not_contained": list(NOT_CONTAINED[launcher.mode])}


def check_limits(**limits: float | None) -> None:
    """Raises ValueError naming the first of `limits` (run_sandboxed's keyword arguments) that is not
    a positive finite number; cpu_s may be None."""
    for name, value in limits.items():
        if value is None and name == "cpu_s":
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0 or not math.isfinite(value):
            raise ValueError(f"sandbox: {name} must be a positive number, got {value!r}")


def _run(
    launcher: _Launcher,
    code: str,
    limits: dict[str, tuple[int, int]],
    timeout_s: float,
    stdin: bytes | None,
    max_output_bytes: int,
    disk_quota_mb: int = 64,
) -> SandboxResult:
    uid = launcher.uids[secrets.randbelow(len(launcher.uids))]
    token = secrets.token_hex(16)
    base = tempfile.mkdtemp(prefix="grpolab-sandbox-")
    try:
        work, argv = _prepare(base, uid, code, limits, launcher, math.ceil(timeout_s) + 1, disk_quota_mb)
        env = {"PATH": _PATH, "HOME": work, "TMPDIR": work, "USER": "sandbox", "LANG": "C.UTF-8", TOKEN_VAR: token}
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, _read_only_file(stdin or b"") as inp:
            t0 = time.monotonic()
            with ACTIVE_LOCK:
                cwd = work if launcher.mode == "setuid" else base  # namespace: setup.py enters work/
                proc = _spawn(launcher, uid, argv, cwd=cwd, env=env, stdin=inp, stdout=out, stderr=err)
                ACTIVE.add(proc.pid)
            returncode = None
            try:
                returncode = wait_unreaped(proc.pid, timeout_s)
            finally:  # also on KeyboardInterrupt: never leave the child running
                _stop(launcher, proc, uid, token)
            wall = time.monotonic() - t0
            timed_out = returncode is None
            if timed_out:
                returncode = -signal.SIGKILL  # ours (unshare's own status is then meaningless)
            elif launcher.mode == "namespace" and returncode > 128 and (returncode - 128) in _SIGNALS:
                returncode = 128 - returncode  # the supervisor's 128 + N: killed by signal N
            stdout, cut_out = _read_capped(out, max_output_bytes)
            stderr, cut_err = _read_capped(err, max_output_bytes)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return SandboxResult(
        returncode=returncode, timed_out=timed_out, stdout=stdout, stderr=stderr,
        truncated=cut_out or cut_err, wall_s=wall,
        reason=_reason(returncode, timed_out, timeout_s, stderr, disk_quota_mb if launcher.mode == "namespace" else None),
    )


def _prepare(base: str, uid: int, code: str, limits: dict[str, tuple[int, int]], launcher: _Launcher,
             deadline_s: int, disk_quota_mb: int) -> tuple[str, list[str]]:
    """Fills the run directory: runner.py and main.py (root's, read-only) and, in setuid mode, work/
    (the sandbox uid's, its cwd). Returns (work dir as the code sees it, the argv to run).

    Namespace mode runs setup.py as root in the new namespaces: it copies runner.py and
    main.py into the run's tmpfs, at /tmp/<basename of base>/, and makes work/ there."""
    os.chmod(base, 0o711)  # the sandbox uid may enter it but not list it
    for name, text in (("runner.py", _RUNNER), ("main.py", code)):
        with open(os.path.join(base, name), "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(os.path.join(base, name), 0o644)
    inside = base if launcher.mode == "setuid" else os.path.join("/tmp", os.path.basename(base))
    cfg = {"program": os.path.join(inside, "main.py"), "limits": limits,
           "block_network": launcher.mode == "setuid", "deadline_s": deadline_s}
    work = os.path.join(inside, "work")
    if launcher.mode == "setuid":
        os.mkdir(work, 0o700)
        os.chown(work, uid, uid)
        return work, [launcher.python, "-I", "-B", os.path.join(base, "runner.py"), json.dumps(cfg)]
    setup = {"host_dir": base, "name": os.path.basename(base), "uid": uid, "python": launcher.python,
             "quota_bytes": disk_quota_mb * 2**20, "runner": cfg}
    return work, [launcher.python, "-I", "-B", "-S", _SETUP, json.dumps(setup)]


def _spawn(launcher: _Launcher, uid: int, argv: list[str], **kwargs) -> subprocess.Popen:
    """Starts the child in a new session. The uid switch is done by setup.py (namespace
    mode, after it has built the mounts) or by Popen's user/group arguments (setuid mode): no
    preexec_fn, so it is safe from threads."""
    if launcher.mode == "namespace":
        argv = [launcher.unshare, "--net", "--pid", "--ipc", "--fork", "--mount-proc", "--propagation", "private",
                "--", *argv]
        return subprocess.Popen(argv, start_new_session=True, **kwargs)
    return subprocess.Popen(argv, start_new_session=True, user=uid, group=uid, extra_groups=[], **kwargs)


def _stop(launcher: _Launcher, proc: subprocess.Popen, uid: int, token: str) -> None:
    """Kills whatever is left of the run (all of it, whether it ended or timed out) and reaps the
    child (its exit status was read before, by wait_unreaped)."""
    if launcher.mode == "namespace":
        kill_namespace(proc.pid)
    try:  # the leader is not reaped yet, so its group id cannot have been reused
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    with ACTIVE_LOCK:
        ACTIVE.discard(proc.pid)
    if launcher.mode == "setuid":
        kill_tagged(uid, token)
        reap_orphans(launcher.uids)


def _read_only_file(data: bytes) -> IO[bytes]:
    """An unlinked file holding `data`, open read-only: the child's stdin, which must not give it a
    writable file on the host's disk."""
    fd, path = tempfile.mkstemp(prefix="grpolab-sandbox-stdin-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return open(path, "rb")
    finally:
        os.unlink(path)


def _read_capped(f: IO[bytes], cap: int) -> tuple[str, bool]:
    """Head and tail of a captured stream, at most `cap` bytes in all. Returns (text, was_cut)."""
    size = f.seek(0, os.SEEK_END)
    f.seek(0)
    if size <= cap:
        return f.read().decode("utf-8", errors="replace"), False
    head = f.read(cap // 2)
    f.seek(size - (cap - cap // 2))
    tail = f.read()
    text = head.decode("utf-8", errors="replace") + f"\n[... {size - cap} bytes cut ...]\n"
    return text + tail.decode("utf-8", errors="replace"), True


def _reason(returncode: int, timed_out: bool, timeout_s: float, stderr: str, quota_mb: int | None = None) -> str:
    """A short summary of the run; quota_mb: the disk quota, when one was enforced (namespace mode)."""
    if timed_out:
        return f"timed out after {timeout_s:g} s"
    if returncode == 0:
        return "ok"
    if quota_mb is not None and "No space left on device" in stderr:  # ENOSPC: only the run's tmpfs is writable
        return f"disk quota of {quota_mb:g} MB exceeded ({_reason(returncode, False, timeout_s, stderr)})"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    last = next((line.strip() for line in reversed(stderr.splitlines()) if line.strip()), "")
    return f"exit code {returncode}" + (f": {last[:200]}" if last else "")


@functools.lru_cache(maxsize=None)
def _resolve(isolation: str, python: str | None) -> _Launcher:
    """Picks a mode and interpreter that actually work, by running a probe program through them.

    Cached per process. Raises SandboxUnavailable (with what was tried) when nothing works."""
    if isolation not in ("auto", *MODES):
        raise ValueError(f"run_sandboxed: isolation must be 'auto', 'namespace' or 'setuid', got {isolation!r}")
    if os.geteuid() != 0:
        raise SandboxUnavailable(
            "the code sandbox needs root, to run model code as an unprivileged uid; refusing to "
            "run it as the training user (run training as root in a container)"
        )
    unshare = shutil.which("unshare", path=_PATH)
    uids = SANDBOX_UIDS if _mapped(SANDBOX_UIDS) else FALLBACK_UIDS
    modes = MODES if isolation == "auto" else (isolation,)
    tried = []
    for mode in modes:
        if mode == "namespace" and unshare is None:
            tried.append("namespace: no `unshare` (util-linux) on PATH")
            continue
        for interp in _interpreters(python):
            launcher = _Launcher(mode, interp, unshare, uids)
            limits = {"RLIMIT_NPROC": (64, 64), "RLIMIT_CORE": (0, 0)}
            try:
                res = _run(launcher, "print('sandbox-ok')", limits, 30.0, None, 4096)
            except OSError as e:
                tried.append(f"{mode} with {interp}: {e}")
                continue
            if res.passed and res.stdout.strip() == "sandbox-ok":
                if isolation == "auto" and mode != MODES[0]:
                    log.warning("code sandbox: isolation %r, the fallback (%s); not contained: %s", mode,
                                "; ".join(tried), "; ".join(NOT_CONTAINED[mode]))
                return launcher
            tried.append(f"{mode} with {interp}: {res.reason}; {res.stderr.strip()[:200]}")
    raise SandboxUnavailable("no working code sandbox; tried:\n  " + "\n  ".join(tried))


def _mapped(ids: range) -> bool:
    """True when this process's user namespace maps every id in `ids`, as uids and as gids."""
    for path in ("/proc/self/uid_map", "/proc/self/gid_map"):
        try:
            with open(path) as f:
                rows = [tuple(map(int, line.split())) for line in f if line.strip()]
        except (OSError, ValueError):
            return True  # no user namespaces here: every id is valid
        if not any(inside <= ids.start and ids.stop <= inside + count for inside, _, count in rows):
            return False
    return True


def _interpreters(python: str | None) -> list[str]:
    """Candidate sandbox interpreters: the one asked for, else $GRPOLAB_SANDBOX_PYTHON, else
    sys.executable then the system python3."""
    chosen = python or os.environ.get("GRPOLAB_SANDBOX_PYTHON")
    if chosen:
        path = shutil.which(chosen) or chosen
        return [os.path.abspath(path)]
    found = [sys.executable, shutil.which("python3", path=_PATH)]
    out: list[str] = []
    for p in found:
        if p and os.path.realpath(p) not in {os.path.realpath(q) for q in out}:
            out.append(os.path.abspath(p))
    return out

