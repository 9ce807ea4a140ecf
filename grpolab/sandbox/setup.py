"""Builds the file system a sandboxed run sees (grpolab.sandbox.sandbox, namespace mode), then drops
to the run's uid and starts the runner.

Run as a script (`python -I -B -S setup.py CONFIG_JSON`), as root, as PID 1 of the run's
fresh mount, PID, network and IPC namespaces (unshare --mount-proc has just mounted a /proc that
shows only them). Mounts made here are private to the namespace: they vanish with it, files and all.

1. Every mount of the host is made read-only (mount_setattr(2), recursive, on "/"; where that
   fails, e.g. on kernels before 5.12, each mount point in turn): nothing of the host's file system is writable, whatever
   its permissions. Device files such as /dev/null stay usable (a read-only mount does not stop
   writes to a device).
2. A tmpfs of `quota_bytes` (and `quota_bytes // 4096` inodes, at least 1024) is mounted over /tmp:
   the only writable place, and the total disk quota of the run. It holds the run directory
   /tmp/NAME (root's, 0711: runner.py and main.py, root's and read-only; work/, the run uid's, its
   cwd) and, bind-mounted over /var/tmp and /dev/shm, NAME/var-tmp and NAME/shm. The host's /tmp
   is hidden.
3. The uid (= gid) is switched, with no supplementary groups, and the runner is exec'ed in work/.

Standard library only, and nothing of grpolab: it runs under the sandbox interpreter, which may be
another Python than the training process's. Any failure ends it with status SETUP_FAILED and one
line on stderr, before the model's code has run.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import re
import sys

SETUP_FAILED = 125
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOSYMFOLLOW, MS_NOATIME, MS_NODIRATIME, MS_BIND = 256, 1024, 2048, 4096
MS_RELATIME, MS_STRICTATIME = 1 << 21, 1 << 24
# per-mount flags a read-only remount keeps (in a user namespace, dropping a locked one fails)
_KEEP = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "nosymfollow": MS_NOSYMFOLLOW,
         "noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}
_MOUNT_SETATTR = {"x86_64": 442, "aarch64": 442, "arm64": 442, "riscv64": 442, "ppc64le": 442, "s390x": 442}
_AT_FDCWD, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY = -100, 0x8000, 1

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str | bytes, target: str | bytes, fstype: str | None, flags: int, data: str | None = None) -> None:
    """mount(2); OSError naming the target on failure."""
    def enc(s: str | bytes | None) -> bytes | None:
        return None if s is None else os.fsencode(s)

    _libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {os.fsdecode(target)}")


def make_host_read_only() -> None:
    """Makes every mount read-only in this (private) mount namespace; the host's stay as they are."""
    nr = _MOUNT_SETATTR.get(platform.machine())
    if nr is not None:
        attr = (ctypes.c_uint64 * 4)(_MOUNT_ATTR_RDONLY, 0, 0, 0)  # attr_set, attr_clr, propagation, userns_fd
        _libc.syscall.restype = ctypes.c_long
        ret = _libc.syscall(ctypes.c_long(nr), ctypes.c_int(_AT_FDCWD), ctypes.c_char_p(b"/"),
                            ctypes.c_uint(_AT_RECURSIVE), attr, ctypes.c_size_t(ctypes.sizeof(attr)))
        if ret == 0:
            return  # else (an old kernel: ENOSYS; a seccomp filter: EPERM) one mount at a time
    with open("/proc/self/mountinfo", "rb") as f:
        rows = [line.split() for line in f]
    for row in rows:  # mount ID, parent ID, major:minor, root, mount point, per-mount options, ...
        target = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), row[4])  # "\040": a space
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for opt in row[5].decode().split(","):
            flags |= _KEEP.get(opt, 0)
        try:
            mount("none", target, None, flags)
        except FileNotFoundError:  # a mount point deleted meanwhile: not reachable by any path
            continue


def build_tmpfs(cfg: dict, runner: bytes, program: bytes) -> str:
    """Mounts the run's tmpfs over /tmp (and /var/tmp, /dev/shm) and fills it. Returns the work dir."""
    quota = int(cfg["quota_bytes"])
    opts = f"size={quota},nr_inodes={max(1024, quota // 4096)},mode=1777"
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, opts)
    base = os.path.join("/tmp", cfg["name"])
    os.mkdir(base, 0o711)
    for name, text in (("runner.py", runner), ("main.py", program)):
        fd = os.open(os.path.join(base, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(text)
    for sub, target in (("var-tmp", "/var/tmp"), ("shm", "/dev/shm")):
        target = os.path.realpath(target)  # e.g. /dev/shm -> /run/shm
        if os.path.isdir(target) and not (target + "/").startswith("/tmp/"):
            os.mkdir(os.path.join(base, sub))
            os.chmod(os.path.join(base, sub), 0o1777)
            mount(os.path.join(base, sub), target, None, MS_BIND)
    work = os.path.join(base, "work")
    os.mkdir(work, 0o700)
    os.chown(work, cfg["uid"], cfg["uid"])
    return work


def main() -> None:
    cfg = json.loads(sys.argv[1])
    with open(os.path.join(cfg["host_dir"], "runner.py"), "rb") as f:
        runner = f.read()
    with open(os.path.join(cfg["host_dir"], "main.py"), "rb") as f:
        program = f.read()
    make_host_read_only()
    work = build_tmpfs(cfg, runner, program)
    uid = cfg["uid"]
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getgroups():
        raise PermissionError(errno.EPERM, "could not drop root")
    os.chdir(work)
    base = os.path.dirname(work)
    os.execv(cfg["python"], [cfg["python"], "-I", "-B", os.path.join(base, "runner.py"), json.dumps(cfg["runner"])])


if __name__ == "__main__":
    try:
        main()
    except BaseException as e:  # noqa: BLE001 - one clear line, then out
        print(f"grpolab sandbox setup failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(SETUP_FAILED)
