"""`grpolab eval` on an environment: held-out episodes of a trained agent run, greedy and sampled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from grpolab import config as C
from grpolab.grpo.run import train_in_run_dir
from grpolab.grpo.setup import build_setup

REPO = Path(__file__).resolve().parents[2]
AGENT = ["model.name_or_path=builtin:tiny-chat", "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
         "environment.name=grpolab.agents.builtin:GuessNumber", "environment.kwargs={n: 9, max_turns: 3}",
         "data.source=builtin:seeds", "data.eval_prompts=6", "rewards=[]", "rollout.max_turns=3",
         "rollout.max_new_tokens=3", "rollout.prompts_per_step=2", "rollout.group_size=2", "train.minibatch_size=4",
         "train.microbatch_size=4", "train.steps=1", "run.progress=false", "run.tensorboard=false",
         "model.dtype=float32"]


def test_grpolab_eval_runs_the_held_out_episodes(tmp_path):
    run = tmp_path / "run"
    assert train_in_run_dir(build_setup(C.from_preset("grpo", AGENT)), run) == 0
    cmd = [sys.executable, "-m", "grpolab.cli", "eval", str(run), "grpo", *AGENT, "--samples", "2",
           "--out", str(tmp_path / "eval.json")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    res = json.loads((tmp_path / "eval.json").read_text())
    assert res["prompts"] == 6 and res["greedy"]["episodes"] == 6 and res["sampled"]["episodes"] == 12
    for part in ("greedy", "sampled"):
        assert 0.0 <= res[part]["solved"] <= 1.0 and res[part]["turns/mean"] >= 1.0
    assert "solved" in done.stdout
