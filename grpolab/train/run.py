"""The run directory: config.yaml, metrics.jsonl, samples.jsonl, TensorBoard, checkpoints, eval.json.

`attach_outputs` adds the per-step writers to a Setup as hooks, so the loop itself does no I/O.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from grpolab import config as C
from grpolab.report.metrics import MetricsLogger


def make_run_dir(cfg: C.Config, default_name: str = "grpo") -> Path:
    """cfg.run.out_dir, or a new runs/<name>-<timestamp> folder."""
    if cfg.run.out_dir:
        path = Path(cfg.run.out_dir)
    else:
        path = Path("runs") / f"{default_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_config(cfg: C.Config, run_dir: Path) -> None:
    C.dump(cfg, str(run_dir / "config.yaml"))


class SamplesWriter:
    """Writes each step's prompt groups (completions, per-reward scores, reward, advantage)."""

    def __init__(self, run_dir: Path, every: int):
        self.path = run_dir / "samples.jsonl"
        self.every = max(1, every)

    def __call__(self, step, row, ro, items, texts, scores) -> None:
        if step % self.every:
            return
        G = ro.group_size
        lengths = ro.completion_lengths.tolist()
        trunc = ro.truncated.tolist()
        rewards = ro.rewards.tolist()
        adv = ro.advantages.tolist()
        per_fn = {k: v.tolist() for k, v in scores.items()}
        with self.path.open("a", encoding="utf-8") as f:
            for g, item in enumerate(items):
                comps = []
                for i in range(g * G, (g + 1) * G):
                    comps.append({
                        "text": texts[i],
                        "rewards": {k: (None if v[i] != v[i] else v[i]) for k, v in per_fn.items()},
                        "reward": None if rewards[i] != rewards[i] else rewards[i],
                        "advantage": adv[i], "length": lengths[i], "truncated": trunc[i],
                    })
                f.write(json.dumps({"step": step, "prompt": item.prompt, "meta": _jsonable(item.meta),
                                    "completions": comps}) + "\n")


def _jsonable(meta: dict) -> dict:
    out = {}
    for k, v in meta.items():
        try:
            json.dumps(v)
            out[k] = v
        except TypeError:
            out[k] = repr(v)
    return out


def attach_outputs(setup, run_dir: Path) -> MetricsLogger:
    """Adds the metrics and samples writers to setup.hooks; returns the logger (close it at the end)."""
    logger = MetricsLogger(run_dir, tensorboard=setup.cfg.run.tensorboard)
    setup.hooks.append(lambda step, row, *rest: logger.log(row))
    setup.hooks.append(SamplesWriter(run_dir, setup.cfg.run.samples_every))
    return logger


def write_eval(run_dir: Path, payload: dict) -> None:
    tmp = run_dir / "eval.json.tmp"
    tmp.write_text(json.dumps(payload, indent=2))
    tmp.replace(run_dir / "eval.json")
