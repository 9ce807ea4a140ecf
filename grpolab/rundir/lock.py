"""One writer per output folder: an exclusive OS file lock (`fcntl.flock`) on `DIR/.grpolab.lock`,
held by the process that writes the folder for as long as it writes it.

The kernel releases the lock when the process ends, however it ends (a SIGKILLed run leaves no stale
lock: the file stays, the lock does not). The file holds the holder's PID, command line and start
time, so a second writer is refused with one message naming them. The same process may lock a folder
it already holds again (a no-op); `release` and `release_all` give the locks back.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import sys
import time
from pathlib import Path

from grpolab.errors import ConfigError, user_path_error

LOCK_FILE = ".grpolab.lock"

_held: dict[str, int] = {}
"""Folder (as given, resolved) -> file descriptor of its lock file, for the folders this process holds."""


class FolderBusyError(ConfigError):
    """Another live process holds the folder's lock; the message names its PID and command."""


def _key(path: Path) -> str:
    return os.path.realpath(path)


def command_line(argv: list[str] | None = None) -> str:
    """This process's command line as a user would type it (`grpolab train ...`)."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return "python"
    head = os.path.basename(argv[0])
    if head in ("grpolab", "__main__.py"):
        return " ".join(["grpolab", *argv[1:]])
    if head == "-c":
        return " ".join(["python -c ...", *argv[1:]])
    return " ".join(argv)


def _holder(fd: int) -> dict:
    """What the holder wrote into the lock file ({} while it has not written it yet)."""
    for _ in range(20):
        try:
            info = json.loads(os.pread(fd, 65536, 0).decode() or "null")
            if isinstance(info, dict):
                return info
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    return {}


def make_folder(path: Path, field: str) -> None:
    """Creates `path` (and its parents); an OSError becomes one ConfigError naming `field` and the path."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise user_path_error(e, field, path) from None
    if not path.is_dir():
        raise ConfigError(f"{field}={str(path)!r}: exists and is not a folder")


def lock_folder(path: str | os.PathLike, field: str = "run.out_dir", command: str = "") -> Path:
    """Creates `path` and takes its lock for this process (FolderBusyError naming the holder's PID and
    command when another process holds it); returns the path."""
    path = Path(path)
    key = _key(path)
    if key in _held:
        return path
    make_folder(path, field)
    try:
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise user_path_error(e, field, path / LOCK_FILE) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            os.close(fd)
            raise user_path_error(e, field, path / LOCK_FILE) from None
        info = _holder(fd)
        os.close(fd)
        who = f"PID {info.get('pid', '?')} ({info.get('command') or 'another grpolab process'})"
        since = f", started {info['started']}" if info.get("started") else ""
        raise FolderBusyError(f"{field}={str(path)!r} is in use by {who}{since}; one process writes a folder at a "
                              "time: wait for it to end (or stop it), or choose another folder") from None
    info = {"pid": os.getpid(), "command": command or command_line(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    _held[key] = fd
    return path


def holds_lock(path: str | os.PathLike) -> bool:
    """Whether this process holds the lock of `path`."""
    return _key(Path(path)) in _held


def release(path: str | os.PathLike) -> None:
    """Gives back this process's lock of `path` (nothing when it holds none)."""
    fd = _held.pop(_key(Path(path)), None)
    if fd is not None:
        os.close(fd)  # closing the last descriptor releases the flock


def release_all() -> None:
    """Gives back every lock this process holds (the end of a command)."""
    for key in list(_held):
        os.close(_held.pop(key))
