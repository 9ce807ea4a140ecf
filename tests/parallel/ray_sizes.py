"""What the Ray tests of this folder share: tiny run sizes, and a run's metrics without its timings.
Workers and trainer are compared token for token, so every size runs float32 on every CPU kind."""

from __future__ import annotations

import json
from pathlib import Path

TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6",
        "train.minibatch_size=8", "train.microbatch_size=4", "train.steps=3", "run.threads=1",
        "run.progress=false", "run.tensorboard=false", "model.dtype=float32"]
"""The built-in task on a 2-layer model, 3 steps."""
AGENT = ["model.name_or_path=builtin:tiny-chat", "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
         "environment.name=grpolab.agents.builtin:GuessNumber", "environment.kwargs={n: 9, max_turns: 3}",
         "data.source=builtin:seeds", "rewards=[]", "rollout.max_turns=3", "rollout.max_new_tokens=4",
         "rollout.prompts_per_step=4", "rollout.group_size=4", "train.minibatch_size=8", "train.microbatch_size=4",
         "train.steps=3", "run.threads=1", "run.progress=false", "run.tensorboard=false", "model.dtype=float32"]
"""GuessNumber episodes (3 turns) on the tiny chat model, 3 steps."""
NOT_COMPARED = ("time/", "tokens_per_s/", "mfu", "sync/")
"""Metric prefixes that differ from run to run (timings)."""


def compared_rows(run_dir: Path) -> list[dict]:
    """run_dir's metrics.jsonl rows without the NOT_COMPARED fields."""
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(NOT_COMPARED)}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_rows(s) -> list[dict]:
    """Trains the Setup `s` (closed afterwards); the metric row of each step."""
    from grpolab.grpo import loop as grpo

    rows: list[dict] = []
    s.services.hooks.append(lambda step, row, record: rows.append(row))
    try:
        grpo.train(s)
    finally:
        s.close()
    return rows


def stop_after_step_1_and_resume(cfg, run_dir: Path) -> None:
    """Runs `cfg` in run_dir stopped the SIGTERM way after step 1 (exit 143, last checkpoint step-2),
    then resumes it from that checkpoint to the end."""
    from grpolab.grpo.run import train_in_run_dir
    from grpolab.grpo.setup import build_setup
    from grpolab.grpo.signals import request_stop
    from grpolab.rundir.checkpoint import complete_checkpoints

    s = build_setup(cfg)
    s.services.hooks.insert(0, lambda step, row, record: request_stop() if step == 1 else None)
    assert train_in_run_dir(s, run_dir) == 143
    assert [p.name for p in complete_checkpoints(run_dir / "checkpoints")][-1] == "step-2"
    assert train_in_run_dir(build_setup(cfg), run_dir, resume_from=run_dir / "checkpoints" / "step-2") == 0


def sample_prompts(run_dir: Path) -> list[tuple[int, str]]:
    """(step, prompt) of each group in run_dir's samples.jsonl."""
    return [(r["step"], r["prompt"]) for r in map(json.loads, (run_dir / "samples.jsonl").read_text().splitlines())]
