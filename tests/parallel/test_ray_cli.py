"""`grpolab train --ray` (a local Ray cluster on this CPU): 2 trainer-rank actors in a placement group
form the torch.distributed group of `--nproc 2` (same metrics as torchrun's ranks); SIGTERM to the
driver stops every rank after its step with a checkpoint, from which `--resume` finishes the run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

HERE = Path(__file__).resolve().parent
NOT_COMPARED = ("time/", "tokens_per_s/", "mfu", "sync/")
TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "rollout.prompts_per_step=4",
        "rollout.group_size=4", "rollout.max_new_tokens=6", "train.minibatch_size=8", "train.microbatch_size=2",
        "train.lr=0.01", "loss.entropy_coef=0.01", "run.threads=1", "run.progress=false", "run.tensorboard=false"]


def _cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "grpolab", "train", "grpo", *TINY, f"run.out_dir={out}", *extra]


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    for k in ("WORLD_SIZE", "RANK", "GRPOLAB_RAY_TRAINER"):
        env.pop(k, None)
    return env


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, env=_env(), cwd=cwd, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def _rows(run: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(x).items() if not k.startswith(NOT_COMPARED)}
            for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_trainer_actors_are_torchruns_ranks_and_a_sigterm_to_the_driver_saves_for_resume(tmp_path):
    """--ray --nproc 2 with one rollout worker (each rank's groups sampled on the worker from the rank's
    own stream, DDP over the actors' gloo group), stopped by SIGTERM to the driver once step 0 is
    logged: the ranks finish their step, save, the driver exits 143, the steps written are those of
    `--nproc 2` under torchrun, and `--resume` (under torchrun) finishes with its metrics and samples."""
    slow = f'rewards=[{{name: "slow_rewards:sleepy", kwargs: {{log: "{tmp_path / "calls.jsonl"}", seconds: 0.5}}}}]'
    common = ["train.steps=5", "run.checkpoint_every=1", slow, "--nproc", "2"]
    run, ref = tmp_path / "ray", tmp_path / "torchrun"
    proc = subprocess.Popen(_cmd(run, *common, "rollout.workers=1", "--ray"), env=_env(), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not (metrics.exists() and metrics.read_text().strip()):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    done = len(_rows(run))
    assert 1 <= done < 5, err[-2000:]
    assert (run / "checkpoints" / f"step-{done}").is_dir()
    _run(_cmd(ref, *common), tmp_path)
    assert _rows(run) == _rows(ref)[:done]
    _run(_cmd(run, *common, "--resume"), tmp_path)
    assert _rows(run) == _rows(ref)
    assert (run / "samples.jsonl").read_text() == (ref / "samples.jsonl").read_text()
    assert len({r["reward/mean"] for r in _rows(ref)}) > 1  # the runs compared are not trivially equal
