"""Agent episodes on Ray rollout workers (CPU): one worker writes the single-process metrics and
samples, and rollout.overlap runs episodes one weight version behind."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from grpolab import config as C  # noqa: E402
from grpolab.grpo.run import train_in_run_dir  # noqa: E402
from grpolab.grpo.setup import build_setup  # noqa: E402

from ray_sizes import AGENT, compared_rows, train_rows  # noqa: E402

AGENT = AGENT + ["loss.entropy_coef=0.01"]


def _rows(run: Path) -> list[dict]:
    return compared_rows(run)


def test_one_rollout_worker_runs_the_single_process_episodes(ray_cluster, tmp_path):
    for name, extra in (("local", []), ("ray", ["rollout.workers=1"])):
        s = build_setup(C.from_preset("grpo", AGENT + extra))
        assert train_in_run_dir(s, tmp_path / name) == 0
    assert len(_rows(tmp_path / "ray")) == 3 and "episode/turns" in _rows(tmp_path / "ray")[0]
    assert _rows(tmp_path / "ray") == _rows(tmp_path / "local")
    samples = (tmp_path / "ray" / "samples.jsonl").read_text()
    assert samples == (tmp_path / "local" / "samples.jsonl").read_text()
    assert '"episode": {' in samples and '"source": "policy"' in samples


def test_overlap_samples_episodes_one_version_behind(ray_cluster):
    rows = train_rows(build_setup(C.from_preset("grpo", AGENT + ["rollout.workers=1", "rollout.overlap=1",
                                                                  "train.lr=0.05"])))
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 1]
    assert all(math.isfinite(r["loss"]) and r["episode/policy_tokens"] > 0 for r in rows)
