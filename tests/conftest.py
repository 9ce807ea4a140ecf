"""Suite-wide hooks: with GRPOLAB_RECORD_SKIPPED=FILE, the node ids of skipped tests are written to FILE,
one per line, so that a second pytest run (`python -m pytest @FILE`) runs exactly those once the
missing extras are installed (.ci/run does this)."""

from __future__ import annotations

import os

_SKIPPED: list[str] = []


def pytest_runtest_logreport(report):
    if report.skipped and report.nodeid not in _SKIPPED:
        _SKIPPED.append(report.nodeid)


def pytest_collectreport(report):
    """A module skipped as a whole (e.g. `pytest.importorskip` at its top) is recorded by its path."""
    if report.skipped and report.nodeid not in _SKIPPED:
        _SKIPPED.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("GRPOLAB_RECORD_SKIPPED")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(f"{node}\n" for node in _SKIPPED)
