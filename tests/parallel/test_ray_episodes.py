"""Agent episodes on Ray rollout workers (CPU): one worker writes the single-process metrics and
samples, and rollout.overlap runs episodes one weight version behind."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from grpolab import config as C  # noqa: E402
from grpolab.grpo import loop as grpo  # noqa: E402
from grpolab.grpo.run import train_in_run_dir  # noqa: E402
from grpolab.grpo.setup import build_setup  # noqa: E402

HERE = Path(__file__).resolve().parent
AGENT = ["model.name_or_path=builtin:tiny-chat", "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
         "environment.name=grpolab.agents.builtin:GuessNumber", "environment.kwargs={n: 9, max_turns: 3}",
         "data.source=builtin:seeds", "rewards=[]", "rollout.max_turns=3", "rollout.max_new_tokens=4",
         "rollout.prompts_per_step=4", "rollout.group_size=4", "train.minibatch_size=8", "train.microbatch_size=4",
         "train.steps=3", "run.threads=1", "run.progress=false", "run.tensorboard=false", "loss.entropy_coef=0.01",
         "model.dtype=float32"]  # workers and trainer compared token for token: float32 on every CPU kind
NOT_COMPARED = ("time/", "tokens_per_s/", "mfu", "sync/")


@pytest.fixture(scope="module")
def cluster():
    path = os.pathsep.join(p for p in (str(HERE), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")) if p)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, namespace="grpolab-tests",
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    torch.set_num_threads(1)
    yield
    ray.shutdown()


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(NOT_COMPARED)} for r in rows]


def test_one_rollout_worker_runs_the_single_process_episodes(cluster, tmp_path):
    for name, extra in (("local", []), ("ray", ["rollout.workers=1"])):
        s = build_setup(C.from_preset("grpo", AGENT + extra))
        assert train_in_run_dir(s, tmp_path / name) == 0
    assert len(_rows(tmp_path / "ray")) == 3 and "episode/turns" in _rows(tmp_path / "ray")[0]
    assert _rows(tmp_path / "ray") == _rows(tmp_path / "local")
    samples = (tmp_path / "ray" / "samples.jsonl").read_text()
    assert samples == (tmp_path / "local" / "samples.jsonl").read_text()
    assert '"episode": {' in samples and '"source": "policy"' in samples


def test_overlap_samples_episodes_one_version_behind(cluster):
    s = build_setup(C.from_preset("grpo", AGENT + ["rollout.workers=1", "rollout.overlap=1", "train.lr=0.05"]))
    rows = []
    s.services.hooks.append(lambda step, row, record: rows.append(row))
    try:
        grpo.train(s)
    finally:
        s.close()
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 1]
    assert all(math.isfinite(r["loss"]) and r["episode/policy_tokens"] > 0 for r in rows)
