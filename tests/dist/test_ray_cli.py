"""`grpolab train --ray` (a local Ray cluster on this CPU): 2 trainer-rank actors in a placement group
form the torch.distributed group of `--nproc 2` (same metrics as torchrun's ranks); SIGTERM to the
driver stops every rank after its step with a checkpoint, from which `--resume` finishes the run with
the metrics of an uninterrupted one."""

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
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
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


def test_two_trainer_actors_are_the_two_ranks_of_torchrun(tmp_path):
    """--ray --nproc 2 with one rollout worker: each rank's groups sampled on the worker from the rank's
    own stream, DDP over the actors' gloo group: the metrics and samples of `--nproc 2` (torchrun)."""
    _run(_cmd(tmp_path / "ray", "train.steps=3", "rollout.workers=1", "--ray", "--nproc", "2"), tmp_path)
    _run(_cmd(tmp_path / "torchrun", "train.steps=3", "--nproc", "2"), tmp_path)
    assert len(_rows(tmp_path / "ray")) == 3
    assert _rows(tmp_path / "ray") == _rows(tmp_path / "torchrun")
    assert (tmp_path / "ray" / "samples.jsonl").read_text() == (tmp_path / "torchrun" / "samples.jsonl").read_text()
    assert (tmp_path / "ray" / "final" / "model.safetensors").is_file()


def test_sigterm_to_the_driver_saves_and_resume_finishes_the_run(tmp_path):
    """SIGTERM once step 0 is logged: the rank finishes its step, saves, the driver exits 143; --resume
    (here in one process) gives the metrics of an uninterrupted run."""
    slow = f'rewards=[{{name: "slow_rewards:sleepy", kwargs: {{log: "{tmp_path / "calls.jsonl"}", seconds: 0.5}}}}]'
    common = ["train.steps=6", "run.checkpoint_every=1", slow]
    run = tmp_path / "run"
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
    assert 1 <= done < 6, err[-2000:]
    assert (run / "checkpoints" / f"step-{done}").is_dir()
    _run(_cmd(run, *common, "--resume"), tmp_path)  # in one process: one worker samples what it samples
    _run(_cmd(tmp_path / "plain", *common), tmp_path)
    assert _rows(run) == _rows(tmp_path / "plain")
