"""Finding, killing and reaping the processes of a sandboxed run (grpolab.sandbox.sandbox), through /proc.

A run's processes may leave its process group (setsid), fork while being killed, or linger as
zombies; these helpers make sure none of them outlives the run.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable

TOKEN_VAR = "GRPOLAB_SANDBOX_RUN"
"""Environment variable carrying each run's random token (setuid mode finds leftovers by it)."""
ACTIVE: set[int] = set()
"""PIDs of the sandbox children not reaped yet: reap_orphans must leave them to their own run."""
ACTIVE_LOCK = threading.Lock()


def wait_unreaped(pid: int, timeout_s: float) -> int | None:
    """Waits for the child to exit, without reaping it (so its process group id stays reserved).

    Returns its exit status as subprocess reports it (negative: killed by that signal), or None if
    the timeout fired first. If something else in this process reaped it, its status is lost: 255."""
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while True:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return 255
        if info is not None:
            return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        time.sleep(min(delay, left))
        delay = min(delay * 2, 0.02)


def kill_namespace(unshare_pid: int) -> None:
    """SIGKILLs the processes of the PID namespace that `unshare` made, until none is left (the
    kernel kills the rest once its first process dies). Needed because the child may have left the
    process group with setsid (unshare's --kill-child would not do: it is void once unshare switches
    uid). Does nothing once unshare has exited: it waits for its child, and a namespace is empty
    once its first process is reaped."""
    try:
        ns = os.readlink(f"/proc/{unshare_pid}/ns/pid_for_children")
    except OSError:
        return
    if ns == os.readlink("/proc/self/ns/pid"):  # unshare has not made its namespace yet
        return
    kill_until_gone(lambda pid: os.readlink(f"/proc/{pid}/ns/pid") == ns)


def kill_tagged(uid: int, token: str) -> None:
    """SIGKILLs leftover processes of this run (setuid mode), found by uid and environment token:
    e.g. ones that left the process group with setsid. A process of the uid whose environ cannot
    be read (ESRCH) or reads empty is already exiting (e.g. killed with the group) or a zombie: it
    is matched too, so that `kill_until_gone` waits until it has died (killing it is a no-op)."""
    needle = f"{TOKEN_VAR}={token}".encode()

    def match(pid: str) -> bool:
        if os.stat(f"/proc/{pid}").st_uid != uid:
            return False
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
        except ProcessLookupError:  # still listed, but exiting: its memory is gone
            return True
        return not environ or needle in environ.split(b"\0")

    kill_until_gone(match)


def kill_until_gone(match: Callable[[str], bool], limit_s: float = 5.0) -> None:
    """Scans /proc and SIGKILLs every live process `match` accepts, until a scan finds none (they
    may be forking meanwhile) and every process killed has died (or `limit_s` passes). A process
    that vanishes mid-check is skipped. The wait matters: a killed process stays alive for a while
    as it exits, and `match` may no longer see it then (its environ reads empty once its memory is
    gone), so an empty scan alone does not mean nothing is left."""
    deadline = time.monotonic() + limit_s
    killed: dict[int, str] = {}  # pid -> its start time, so a reused pid is not waited for
    while time.monotonic() < deadline:
        found = False
        for pid in os.listdir("/proc"):
            try:
                if pid.isdigit() and match(pid):
                    fields = stat_fields(int(pid))
                    if fields[0] in DEAD_STATES:
                        continue
                    os.kill(int(pid), signal.SIGKILL)
                    killed[int(pid)] = fields[19]  # field 22 of proc(5): start time
                    found = True
            except OSError:
                continue
        killed = {pid: start for pid, start in killed.items() if still_running(pid, start)}
        if not found and not killed:
            return
        time.sleep(0.01)


DEAD_STATES = ("Z", "X", "x")  # zombie, dead


def stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command name: [state, ppid, ...] (OSError if the process is gone)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def still_running(pid: int, start: str) -> bool:
    """Whether process `pid` (started at `start`) exists and has not yet died (zombie or dead)."""
    try:
        fields = stat_fields(pid)
    except OSError:
        return False
    return fields[19] == start and fields[0] not in DEAD_STATES


def reap_orphans(uids: range) -> None:
    """Reaps dead sandbox processes re-parented to this process (setuid mode, when it is PID 1 of a
    container or a subreaper): nothing else would, and each zombie holds a PID."""
    me = str(os.getpid())
    with ACTIVE_LOCK:
        for pid in os.listdir("/proc"):
            try:
                if not pid.isdigit() or int(pid) in ACTIVE or os.stat(f"/proc/{pid}").st_uid not in uids:
                    continue
                state, ppid = stat_fields(int(pid))[:2]
                if state == "Z" and ppid == me:
                    os.waitpid(int(pid), os.WNOHANG)
            except (OSError, ValueError):
                continue
