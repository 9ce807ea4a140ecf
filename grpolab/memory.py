"""The C heap of a CPU process: hand freed pages back to the OS between phases, or keep them.

glibc only (through ctypes); elsewhere both functions do nothing.
"""

from __future__ import annotations


def release_free_memory() -> None:
    """Returns freed heap pages to the OS (glibc `malloc_trim`; a no-op elsewhere, and after
    `keep_freed_memory`).

    Rollouts and training microbatches of varying lengths fragment the C heap that CPU tensors
    live in; trimming after the large short-lived KV cache is freed keeps the peak RSS of the
    next phase lower.
    """
    libc = _libc()
    if libc and not _KEEP_FREED:
        libc.malloc_trim(0)


def keep_freed_memory() -> bool:
    """Makes this process keep the memory it frees for reuse (train.keep_freed_memory; glibc only).

    `release_free_memory` no longer trims, and glibc's mmap and trim thresholds go to 1 GiB
    (`mallopt`), so a freed large tensor's pages stay in the heap instead of being unmapped. The
    next phase then reuses them instead of page-faulting fresh, zeroed pages in. Process-wide and
    not undone. Returns False where there
    is no glibc (nothing changes).
    """
    global _KEEP_FREED
    libc = _libc()
    if not libc:
        return False
    libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)
    libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    _KEEP_FREED = True
    return True


def _libc():
    """glibc through ctypes, or False where it cannot be loaded (looked up once)."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
            _LIBC.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC


_LIBC = None
_KEEP_FREED = False
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
