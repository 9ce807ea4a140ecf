"""grpolab.memory: the heap policy between phases (glibc malloc_trim / mallopt)."""

from __future__ import annotations


class _FakeLibc:
    """Records the glibc calls of release_free_memory / keep_freed_memory."""

    def __init__(self):
        self.calls = []

    def malloc_trim(self, pad):
        self.calls.append(("malloc_trim", pad))

    def mallopt(self, param, value):
        self.calls.append(("mallopt", param, value))
        return 1


def test_keep_freed_memory_raises_the_thresholds_and_stops_the_trims(monkeypatch):
    import grpolab.memory as memory

    libc = _FakeLibc()
    monkeypatch.setattr(memory, "_LIBC", libc)
    monkeypatch.setattr(memory, "_KEEP_FREED", False)  # restored after the test: the switch is process-wide
    memory.release_free_memory()
    assert libc.calls == [("malloc_trim", 0)]
    assert memory.keep_freed_memory() is True
    assert libc.calls[1:] == [("mallopt", -3, 1 << 30), ("mallopt", -1, 1 << 30)]  # M_MMAP_, M_TRIM_THRESHOLD
    memory.release_free_memory()
    assert len(libc.calls) == 3  # no further trim


def test_keep_freed_memory_without_glibc_changes_nothing(monkeypatch):
    import grpolab.memory as memory

    monkeypatch.setattr(memory, "_LIBC", False)
    monkeypatch.setattr(memory, "_KEEP_FREED", False)
    assert memory.keep_freed_memory() is False
    assert memory._KEEP_FREED is False
