"""Suite-wide hooks: with GRPOLAB_RECORD_SKIPPED=FILE, the node ids of skipped tests are written to FILE,
one per line, so that a second pytest run (`python -m pytest @FILE`) runs exactly those once the
missing extras are installed (.ci/run does this). Also the `ray_cluster` fixture."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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


@pytest.fixture(scope="module")
def ray_cluster(request):
    """A local Ray cluster (CPU) for the requesting test module: `RAY_CPUS` of the module (default 8)
    logical CPUs; its workers import the module's folder and the repository; one torch thread here."""
    import torch

    ray = pytest.importorskip("ray")
    here = Path(request.module.__file__).resolve().parent
    path = os.pathsep.join(p for p in (str(here), str(Path(__file__).resolve().parents[1]),
                                       os.environ.get("PYTHONPATH", "")) if p)
    ray.init(num_cpus=getattr(request.module, "RAY_CPUS", 8), include_dashboard=False, log_to_driver=False,
             namespace="grpolab-tests", runtime_env={"env_vars": {"PYTHONPATH": path}})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    ray.shutdown()
