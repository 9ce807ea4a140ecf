"""The code sandbox: every hostile program is contained, fails, and leaves the test process alive.

Each test runs in both isolation modes where this machine supports them (namespace needs root and
a working `unshare`; setuid needs root). Limits are small so a fork bomb cannot hurt a shared box.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from grpolab.sandbox import procs as sandbox_procs, sandbox
from grpolab.sandbox.sandbox import FALLBACK_UIDS, MODES, SANDBOX_UIDS, SandboxUnavailable, run_sandboxed, sandbox_info

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the code sandbox needs root (it switches to an unprivileged uid)")

SMALL = dict(timeout_s=2.0, memory_mb=256, max_procs=16)
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _mode_works(mode: str) -> bool:
    try:
        return os.geteuid() == 0 and sandbox_info(mode)["mode"] == mode
    except SandboxUnavailable:
        return False


@pytest.fixture(params=[
    pytest.param(m, marks=pytest.mark.skipif(not _mode_works(m), reason=f"isolation {m!r} does not work here"))
    for m in MODES
])
def mode(request) -> str:
    return request.param


def _is_sandbox_uid(uid: int) -> bool:
    return uid in SANDBOX_UIDS or uid in FALLBACK_UIDS


def _live_sandbox_pids() -> set[int]:
    """PIDs of live (not zombie) processes of sandbox uids."""
    out = set()
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and _is_sandbox_uid(os.stat(f"/proc/{pid}").st_uid):
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                        out.add(int(pid))
        except OSError:
            continue
    return out


def test_correct_program_runs_unprivileged_in_a_throwaway_dir(mode):
    code = "import os\nprint(os.getuid(), os.getgid(), os.getgroups())\nprint(os.getcwd())\nopen('f.txt', 'w').write('ok')"
    res = run_sandboxed(code, isolation=mode, **SMALL)
    assert res.passed and res.returncode == 0 and not res.timed_out and res.reason == "ok"
    ids, cwd = res.stdout.splitlines()
    uid, gid, groups = ids.split(" ", 2)
    assert uid == gid and _is_sandbox_uid(int(uid)) and groups == "[]"
    assert int(uid) in sandbox_info(mode)["uids"]
    assert os.path.basename(cwd) == "work" and os.path.basename(os.path.dirname(cwd)).startswith("grpolab-sandbox-")
    assert not os.path.exists(os.path.dirname(cwd))  # removed afterwards


def test_failing_program_reports_its_error(mode):
    res = run_sandboxed("import sys\nprint('before')\nraise ValueError('boom')", isolation=mode, **SMALL)
    assert not res.passed and res.returncode == 1
    assert res.stdout == "before\n" and "ValueError: boom" in res.stderr
    assert res.reason == "exit code 1: ValueError: boom"


def test_stdin_is_fed(mode):
    res = run_sandboxed("import sys\nprint(sys.stdin.read()[::-1])", stdin="abc", isolation=mode, **SMALL)
    assert res.passed and res.stdout == "cba\n"


@pytest.mark.parametrize("code", ["while True:\n    pass", "import time\ntime.sleep(60)"], ids=["busy", "sleep"])
def test_infinite_loop_times_out(mode, code):
    res = run_sandboxed(code, isolation=mode, **{**SMALL, "timeout_s": 1.0})
    assert res.timed_out and not res.passed and res.returncode == -signal.SIGKILL
    assert res.reason == "timed out after 1 s"
    assert 1.0 <= res.wall_s < 3.0


def test_cpu_limit_kills_before_the_wall_clock(mode):
    res = run_sandboxed("while True:\n    pass", isolation=mode, cpu_s=1, **{**SMALL, "timeout_s": 8.0})
    assert not res.timed_out and not res.passed
    assert res.returncode in (-signal.SIGXCPU, -signal.SIGKILL), res.reason


FORK_BOMBS = {
    "plain": "import os\nwhile True:\n    os.fork()",
    # ignores fork failures and leaves the process group, so killing the group is not enough
    "setsid": "import os\nwhile True:\n    try:\n        os.fork()\n        os.setsid()\n    except OSError:\n        pass",
    # exits 0 at once, leaving detached sleepers behind
    "detached": textwrap.dedent("""\
        import os, time
        for _ in range(50):
            try:
                if os.fork() == 0:
                    os.setsid()
                    time.sleep(600)
            except OSError:
                pass
        """),
}


@pytest.mark.parametrize("name", list(FORK_BOMBS))
def test_fork_bomb_is_contained_and_leaves_no_process(mode, name):
    before = _live_sandbox_pids()
    res = run_sandboxed(FORK_BOMBS[name], isolation=mode, **{**SMALL, "timeout_s": 1.5})
    if name != "detached":
        assert not res.passed
    assert res.wall_s < 4.0
    assert _live_sandbox_pids() <= before, "sandbox processes outlived the run"


def test_a_fork_bomb_does_not_starve_a_concurrent_run(mode):
    """Each run has its own uid, hence its own RLIMIT_NPROC count."""
    forks_once = "import os\npid = os.fork()\nif pid == 0:\n    os._exit(7)\nassert os.waitpid(pid, 0)[1] >> 8 == 7"
    with ThreadPoolExecutor(2) as pool:
        bomb = pool.submit(run_sandboxed, FORK_BOMBS["setsid"], isolation=mode, **{**SMALL, "timeout_s": 1.5})
        time.sleep(0.5)  # the bomb is at its limit by now
        fair = run_sandboxed(forks_once, isolation=mode, **SMALL)
        assert not bomb.result().passed
    assert fair.passed, fair.reason


def test_a_dead_parent_leaves_no_sandbox_behind(mode, tmp_path):
    """If the training process dies mid-run, the sandbox still ends soon after its deadline
    (timeout rounded up + 1 s): an alarm in the sandbox, not our timer, stops it."""
    script = tmp_path / "dies.py"
    script.write_text(textwrap.dedent(f"""\
        import os, signal, threading, time
        from grpolab.sandbox.sandbox import run_sandboxed
        threading.Thread(target=run_sandboxed, args=("import time\\ntime.sleep(60)",),
                         kwargs=dict(isolation={mode!r}, timeout_s=1.0), daemon=True).start()
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
        """))
    before = _live_sandbox_pids()
    tmp = tempfile.mkdtemp(prefix="grpolab-test-tmp-")  # the dead parent cannot remove its run dir
    os.chmod(tmp, 0o711)
    try:
        out = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=60, cwd=_REPO,
                             env={**os.environ, "TMPDIR": tmp})
        assert out.returncode == -signal.SIGKILL, out.stderr
        assert _live_sandbox_pids() - before, "the sandbox should still be running right after its parent died"
        deadline = time.monotonic() + 6.0
        while _live_sandbox_pids() - before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _live_sandbox_pids() - before
    finally:
        shutil.rmtree(tmp)


@pytest.mark.parametrize("code", ["x = bytearray(10**11)", "l = []\nwhile True:\n    l.append(' ' * 10**6)"],
                         ids=["huge", "growing"])
def test_huge_allocation_fails_with_memory_error(mode, code):
    res = run_sandboxed(code, isolation=mode, **SMALL)
    assert not res.passed and not res.timed_out
    assert "MemoryError" in res.stderr


def _outside_dir() -> str:
    """A fresh directory of root's outside the temporary dirs (namespace mode hides the host's /tmp)."""
    for parent in ("/var/lib", "/srv", "/opt", _REPO):
        try:
            return tempfile.mkdtemp(prefix=".grpolab-test-outside-", dir=parent)
        except OSError:
            continue
    pytest.skip("no place outside the temporary dirs to make a directory")


def _under_a_tmp_dir(path: str) -> bool:
    real = os.path.realpath(path)
    return any(real.startswith(os.path.realpath(d) + os.sep) for d in ("/tmp", "/var/tmp", "/dev/shm", tempfile.gettempdir()))


def test_writing_outside_the_sandbox_fails(mode):
    with open(__file__, "rb") as f:
        this_file = f.read()
    outside = _outside_dir()
    os.chmod(outside, 0o755)  # root's, and readable by all: the write must fail on permission alone
    target = os.path.join(outside, "pwned.txt")
    refused = ("PermissionError", "Read-only file system")  # setuid mode; namespace mode: all is read-only
    try:
        code = f"import os\nprint(os.listdir({outside!r}))\nopen({target!r}, 'w').write('x')"
        res = run_sandboxed(code, isolation=mode, **SMALL)
        assert res.stdout == "[]\n"  # the directory was reachable
        assert not res.passed and any(r in res.stderr for r in refused), res.stderr
        assert not os.path.exists(target)
        # nor can it replace files of the package (e.g. this test file); a checkout under a temporary
        # dir is not even visible in namespace mode (a private tmpfs covers those dirs)
        hidden = mode == "namespace" and _under_a_tmp_dir(__file__)
        res = run_sandboxed(f"open({__file__!r}, 'a').write('# pwned')", isolation=mode, **SMALL)
        assert not res.passed and any(r in res.stderr for r in refused + ("FileNotFoundError",) * hidden), res.stderr
    finally:
        shutil.rmtree(outside)
    with open(__file__, "rb") as f:
        assert f.read() == this_file


def test_network_is_unreachable(mode):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.2)
        port = server.getsockname()[1]
        code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\ns.sendall(b'hi')"
        res = run_sandboxed(code, isolation=mode, **SMALL)
        assert not res.passed and "Error" in res.reason
        with pytest.raises(socket.timeout):
            server.accept()


def test_unbounded_output_is_cut(mode):
    res = run_sandboxed("while True:\n    print('x' * 1000)", isolation=mode, file_size_mb=1,
                        max_output_bytes=4096, **SMALL)
    assert not res.passed and not res.timed_out and res.truncated
    assert "File too large" in res.stderr
    assert len(res.stdout.encode()) < 4096 + 100


@pytest.mark.parametrize("code", [
    "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
    "import os, signal\nos.kill(1, signal.SIGKILL)",
    "import os, signal\nfor p in os.listdir('/proc'):\n    if p.isdigit() and int(p) != os.getpid():\n"
    "        try:\n            os.kill(int(p), signal.SIGKILL)\n        except OSError:\n            pass\n"
    "os.kill(-1, signal.SIGKILL)",
], ids=["parent", "init", "everyone"])
def test_killing_the_parent_does_not_reach_us(mode, code):
    res = run_sandboxed(code, isolation=mode, **SMALL)
    assert res.wall_s < 4.0
    # still here; and so is a process of ours that is not the parent
    with subprocess.Popen(["sleep", "5"]) as p:
        run_sandboxed(code.replace("os.getppid()", str(p.pid)), isolation=mode, **SMALL)
        assert p.poll() is None
        p.kill()


def test_secrets_in_the_parent_environment_are_not_visible(mode, monkeypatch):
    secret = "grpolab-test-secret-4f1e9c"
    monkeypatch.setenv("GRPOLAB_TEST_SECRET", secret)
    code = textwrap.dedent("""\
        import os
        print(sorted(os.environ))
        for p in os.listdir('/proc'):
            try:
                with open(f'/proc/{p}/environ', 'rb') as f:
                    print(p, f.read())
            except OSError:
                pass
        """)
    res = run_sandboxed(code, isolation=mode, **SMALL)
    assert res.passed, res.reason
    assert "GRPOLAB_TEST_SECRET" not in res.stdout and secret not in res.stdout
    assert res.stdout.splitlines()[0] == str(sorted(["HOME", "LANG", "PATH", "TMPDIR", "USER", "GRPOLAB_SANDBOX_RUN"]))


def test_orphans_reparented_to_us_are_reaped(tmp_path):
    """When the training process is PID 1 of a container (or a subreaper), the sandbox's orphans
    become its children; setuid mode must reap them, or each leaves a zombie holding a PID."""
    if not _mode_works("setuid"):
        pytest.skip("isolation 'setuid' does not work here")
    script = tmp_path / "subreaper.py"
    script.write_text(textwrap.dedent(f"""\
        import ctypes, os, time
        from grpolab.sandbox.sandbox import run_sandboxed
        assert ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
        run_sandboxed({FORK_BOMBS["plain"]!r}, isolation="setuid", timeout_s=1.5, memory_mb=256, max_procs=16)
        time.sleep(0.2)
        run_sandboxed("pass", isolation="setuid")
        me = str(os.getpid())
        zombies = []
        for p in os.listdir("/proc"):
            try:
                with open(f"/proc/{{p}}/stat") as f:
                    state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            except OSError:
                continue
            if state == "Z" and ppid == me:
                zombies.append(p)
        print("zombies", len(zombies))
        """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=_REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "zombies 0"


def test_a_leftover_whose_environ_cannot_be_read_is_killed_and_waited_for(monkeypatch):
    """Setuid mode finds a run's leftovers by uid and environment token. A process already exiting
    (e.g. killed with its group) is still listed, but opening its environ fails with ESRCH: it must
    count as a leftover and be waited for, or the run returns while it is still alive (a CI flake of
    the fork-bomb test). Simulated here: a sleeping process of a sandbox uid whose environ 'fails'."""
    if not _mode_works("setuid"):
        pytest.skip("isolation 'setuid' does not work here")
    info = sandbox_info("setuid")
    uid = info["uids"][0]
    proc = subprocess.Popen([info["python"], "-c", "import time; time.sleep(60)"], user=uid, group=uid,
                            extra_groups=[], cwd="/", start_new_session=True)
    real_open = open

    def exiting_open(path, *args, **kwargs):
        if str(path) == f"/proc/{proc.pid}/environ":
            raise ProcessLookupError(3, "No such process")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(sandbox_procs, "open", exiting_open, raising=False)
    try:
        sandbox_procs.kill_tagged(uid, "not-this-process's-token")
        assert proc.poll() is not None or _state(proc.pid) == "Z", "the leftover is still running"
        assert proc.wait(timeout=5) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.parametrize("kwargs", [
    dict(timeout_s=0), dict(timeout_s=float("inf")), dict(memory_mb=-1), dict(max_procs=0),
    dict(cpu_s=0), dict(max_output_bytes=True), dict(isolation="docker"),
])
def test_bad_arguments_are_named(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        run_sandboxed("pass", **kwargs)


def test_refuses_to_run_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxUnavailable, match="needs root"):
        sandbox._resolve.__wrapped__("auto", None)


def test_a_broken_interpreter_is_reported():
    with pytest.raises(SandboxUnavailable, match="/nonexistent/python"):
        sandbox._resolve.__wrapped__("auto", "/nonexistent/python")


def test_without_mounts_namespace_mode_refuses_and_auto_falls_back_saying_what_is_open(monkeypatch, tmp_path, caplog):
    """Where the sandbox's mounts cannot be made (simulated: a setup script that fails as a refused
    mount would), isolation="namespace" refuses, and "auto" falls back to setuid with a warning
    that names what is not contained."""
    if not _mode_works("namespace"):
        pytest.skip("isolation 'namespace' does not work here")
    failing = tmp_path / "setup.py"
    failing.write_text("import sys\nprint('grpolab sandbox setup failed: PermissionError: mount /tmp: refused',"
                       " file=sys.stderr)\nsys.exit(125)\n")
    os.chmod(tmp_path, 0o755)
    monkeypatch.setattr(sandbox, "_SETUP", str(failing))
    with pytest.raises(SandboxUnavailable, match="sandbox setup failed: PermissionError: mount /tmp"):
        sandbox._resolve.__wrapped__("namespace", None)
    if not _mode_works("setuid"):
        return
    with caplog.at_level("WARNING", logger=sandbox.__name__):
        assert sandbox._resolve.__wrapped__("auto", None).mode == "setuid"
    assert "not contained" in caplog.text and "no total quota" in caplog.text and "/proc" in caplog.text
