"""Exceptions shared across grpolab that no other module should have to import a subsystem for."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad configuration value; the message names the field (and file:line when known)."""


class WorkerLostError(RuntimeError):
    """A worker process of the run (a Ray rollout or reward actor) died; the message names the worker,
    why it ended when known, and how to continue (--resume from the last complete checkpoint)."""


_OS_REASONS = {
    "ENOTDIR": "a part of it is a file, not a folder",
    "EEXIST": "it exists and is not a folder",
    "EISDIR": "it is a folder, not a file",
    "ENOSPC": "no space left on the device",
    "EDQUOT": "the disk quota is exceeded",
    "EACCES": "permission denied",
    "EPERM": "permission denied",
    "EROFS": "the file system is read-only",
    "ENOENT": "it does not exist",
    "ENAMETOOLONG": "the name is too long",
}


def os_reason(e: OSError) -> str:
    """What an OSError means, in words (e.g. "no space left on the device")."""
    import errno

    return _OS_REASONS.get(errno.errorcode.get(e.errno or 0, "")) or e.strerror or str(e)


def user_path_error(e: OSError, field: str, path) -> ConfigError:
    """An OSError about a path the user chose, as one ConfigError naming the field (or flag), the path
    and the reason in words."""
    reason = os_reason(e)
    culprit = f" ({e.filename})" if e.filename and str(e.filename) != str(path) else ""
    return ConfigError(f"{field}={str(path)!r}: cannot be written: {reason}{culprit}")
