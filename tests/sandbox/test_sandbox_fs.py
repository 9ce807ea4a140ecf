"""The code sandbox's file system and /proc (issue 40): a total disk quota on a private tmpfs that is
gone after the run, the sandbox's own /proc, and nothing of the host's file system writable.

These hold in namespace mode only; where that mode does not work they are skipped (setuid mode
says what it leaves uncontained in `sandbox_info()["not_contained"]`, tested here too).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from grpolab.sandbox.sandbox import FALLBACK_UIDS, SANDBOX_UIDS, SandboxUnavailable, run_sandboxed, sandbox_info


def _namespace_works() -> bool:
    try:
        return os.geteuid() == 0 and sandbox_info("namespace")["mode"] == "namespace"
    except SandboxUnavailable:
        return False


pytestmark = pytest.mark.skipif(
    not _namespace_works(), reason="isolation 'namespace' (root, util-linux unshare, mount namespaces) does not work here")

SMALL = dict(timeout_s=3.0, memory_mb=256, max_procs=16, isolation="namespace")
HOST_TMP_DIRS = [d for d in ("/tmp", "/var/tmp", "/dev/shm", tempfile.gettempdir()) if os.path.isdir(d)]


def _sandbox_owned(dirs: list[str]) -> list[str]:
    """Entries of `dirs` (one level) owned by a sandbox uid."""
    out = []
    for d in dirs:
        for name in os.listdir(d):
            try:
                uid = os.lstat(os.path.join(d, name)).st_uid
            except OSError:
                continue
            if uid in SANDBOX_UIDS or uid in FALLBACK_UIDS:
                out.append(os.path.join(d, name))
    return out


def _remove(paths: list[str]) -> None:
    """Test cleanup, should the sandbox have leaked (today's code did)."""
    for p in paths:
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        elif os.path.lexists(p):
            os.unlink(p)


def _leaked(token: str) -> list[str]:
    return [os.path.join(d, n) for d in HOST_TMP_DIRS + ["/run/lock"] if os.path.isdir(d)
            for n in os.listdir(d) if token in n]


def test_the_disk_quota_is_total_across_many_small_files_and_nothing_is_left():
    """Each file is far below RLIMIT_FSIZE (16 MB); together they pass the 64 MB default quota."""
    token = secrets.token_hex(6)
    before = set(_sandbox_owned(HOST_TMP_DIRS))
    code = textwrap.dedent(f"""\
        import os
        for i in range(100):  # 100 MB in 1 MB files, spread over the working dir and /tmp
            where = '/tmp' if i % 2 else '.'
            with open(os.path.join(where, 'fill-{token}-%d' % i), 'wb') as f:
                f.write(b'x' * 2**20)
        """)
    try:
        res = run_sandboxed(code, **SMALL)
        assert not res.passed and not res.timed_out
        assert res.reason.startswith("disk quota of 64 MB exceeded"), res.reason
        assert "No space left on device" in res.stderr
        assert _leaked(token) == []
        assert set(_sandbox_owned(HOST_TMP_DIRS)) <= before
    finally:
        _remove(_leaked(token))


def test_a_smaller_quota_and_an_inode_flood_give_the_quota_reason():
    res = run_sandboxed("open('a', 'wb').write(b'x' * 3 * 2**20)", disk_quota_mb=2, **SMALL)
    assert not res.passed and res.reason.startswith("disk quota of 2 MB exceeded"), res.reason
    # empty files use no blocks, only inodes: those are capped too
    res = run_sandboxed("for i in range(100000):\n    open('/tmp/e%d' % i, 'w').close()", disk_quota_mb=1, **SMALL)
    assert not res.passed and res.reason.startswith("disk quota of 1 MB exceeded"), res.reason
    with pytest.raises(ValueError, match="disk_quota_mb"):
        run_sandboxed("pass", disk_quota_mb=0)


def test_temporary_files_are_private_during_and_gone_after_the_run():
    token = secrets.token_hex(6)
    names = [os.path.join(d, f"grpolab-private-{token}") for d in ("/tmp", "/var/tmp", "/dev/shm") if os.path.isdir(d)]
    code = textwrap.dedent(f"""\
        import os, time
        for p in {names!r}:
            open(p, 'w').write('x')
        print(len(os.listdir('/tmp')))
        time.sleep(1.0)
        print(all(os.path.exists(p) for p in {names!r}))
        """)
    seen: list[str] = []
    results = []
    worker = threading.Thread(target=lambda: results.append(run_sandboxed(code, **SMALL)))
    try:
        worker.start()
        while worker.is_alive():
            seen += [p for p in names if os.path.exists(p)]
            time.sleep(0.02)
        worker.join()
        res = results[0]
        assert res.passed, res.reason
        lines = res.stdout.split()
        assert lines[-1] == "True"  # the sandbox saw its own files the whole time
        assert int(lines[0]) <= 2, "the sandbox sees the host's /tmp"  # only its own file (and run dir)
        assert seen == [], "the sandbox's temporary files were visible on the host during the run"
        assert not [p for p in names if os.path.exists(p)], "the sandbox's temporary files outlived the run"
    finally:
        _remove([p for p in names if os.path.lexists(p)])


def test_host_processes_and_their_arguments_are_invisible():
    secret = f"grpolab-SECRETARG-{secrets.token_hex(6)}"
    code = textwrap.dedent("""\
        import os
        pids = [p for p in os.listdir('/proc') if p.isdigit()]
        print(len(pids))
        for p in pids:
            for what in ('cmdline', 'environ'):
                try:
                    with open(f'/proc/{p}/{what}', 'rb') as f:
                        print(p, what, f.read())
                except OSError:
                    pass
        """)
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", secret]) as sleeper:
        try:
            deadline = time.monotonic() + 5.0
            while not _cmdline_has(sleeper.pid, secret) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert _cmdline_has(sleeper.pid, secret)  # it is there to be seen (once exec'ed)
            res = run_sandboxed(code, **SMALL)
        finally:
            sleeper.kill()
    assert res.passed, res.reason
    assert secret not in res.stdout, "the sandbox read a host process's command line"
    assert int(res.stdout.split()[0]) <= 2  # the sandbox's supervisor and the code itself


def _cmdline_has(pid: int, text: str) -> bool:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return text.encode() in f.read()


def _outside_tmp_dir() -> str:
    """A world-writable directory of the host's outside the temporary dirs, holding a world-writable file."""
    for parent in ("/var/lib", "/srv", "/opt", os.path.dirname(os.path.dirname(os.path.dirname(__file__)))):
        try:
            d = tempfile.mkdtemp(prefix=".grpolab-test-ww-", dir=parent)
        except OSError:
            continue
        os.chmod(d, 0o1777)
        with open(os.path.join(d, "open.txt"), "w") as f:
            f.write("host\n")
        os.chmod(os.path.join(d, "open.txt"), 0o666)
        return d
    pytest.skip("no place outside the temporary dirs to make a world-writable directory")


def test_nothing_of_the_host_file_system_is_writable():
    token = secrets.token_hex(6)
    outside = _outside_tmp_dir()
    dirs = [outside, "/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock", "/dev/mqueue", "/", "/dev", "/run"]
    dirs = [d for d in dirs if os.path.isdir(d)]
    code = textwrap.dedent(f"""\
        import os
        wrote = []
        for d in {dirs!r}:
            try:
                with open(os.path.join(d, 'pwn-{token}'), 'w') as f:
                    f.write('x')
                wrote.append(d)
            except OSError:
                pass
        try:
            open({os.path.join(outside, "open.txt")!r}, 'a').write('pwned\\n')
            wrote.append('open.txt')
        except OSError as e:
            print('open.txt:', e)
        try:
            os.write(0, b'x')  # stdin: a file on the host's disk
            wrote.append('stdin')
        except OSError:
            pass
        open('in-cwd', 'w').write('x')  # its own tmpfs is writable
        print(wrote)
        """)
    try:
        res = run_sandboxed(code, **SMALL)
        assert res.passed, res.reason
        assert "Read-only file system" in res.stdout
        wrote = res.stdout.splitlines()[-1]
        assert set(eval(wrote)) <= {"/tmp", "/var/tmp", "/dev/shm"}, f"the sandbox wrote to the host: {wrote}"
        host_files = [os.path.join(d, f"pwn-{token}") for d in dirs]
        assert not [p for p in host_files if os.path.exists(p)], "files written by the sandbox are on the host"
        with open(os.path.join(outside, "open.txt")) as f:
            assert f.read() == "host\n"
    finally:
        _remove([os.path.join(d, f"pwn-{token}") for d in dirs])
        shutil.rmtree(outside)


def test_shared_memory_segments_do_not_outlive_the_run():
    """SysV shared memory is no file, yet outlives its processes unless its IPC namespace dies."""
    code = textwrap.dedent("""\
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        shmid = libc.shmget(0, 2**20, 0o1000 | 0o600)  # IPC_PRIVATE, IPC_CREAT
        assert shmid >= 0, ctypes.get_errno()
        print(shmid)
        """)
    res = run_sandboxed(code, **SMALL)
    leaked = []
    with open("/proc/sysvipc/shm") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    for row in rows:  # key shmid perms size cpid lpid nattch uid ...
        if int(row[7]) in SANDBOX_UIDS or int(row[7]) in FALLBACK_UIDS:
            leaked.append(row[1])
            subprocess.run(["ipcrm", "-m", row[1]], check=False)
    assert res.passed, res.reason
    assert leaked == [], "a shared memory segment of the sandbox outlived the run"


def test_sandbox_info_says_what_each_mode_does_not_contain():
    assert sandbox_info("namespace")["not_contained"] == []
    assert sandbox_info("namespace")["disk_quota"] is True
    try:
        info = sandbox_info("setuid")
    except SandboxUnavailable:
        return
    assert info["disk_quota"] is False
    text = " ".join(info["not_contained"])
    for words in ("network", "/tmp", "quota", "/proc"):
        assert words in text, text
