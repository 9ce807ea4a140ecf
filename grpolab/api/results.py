"""What the Python API's run functions return."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def read_metrics(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl rows (one per step); [] before its first step."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@dataclass(frozen=True)
class TrainResult:
    """A `train` run (GRPO or any preset of the spectrum)."""

    run_dir: Path
    """The run directory (config.yaml, metrics.jsonl, samples.jsonl, checkpoints/, final/)."""
    exit_code: int
    """What `grpolab train` exits with: 0 finished (or stopped by a callback), 3 stopped by the numerics
    guard, 128 + N stopped by signal N."""
    metrics: list[dict] = field(default_factory=list)
    """metrics.jsonl: one row per step."""
    final_model: Path | None = None
    """final/ (an HF folder) when the run finished; None when it stopped early (see `checkpoint`)."""
    checkpoint: Path | None = None
    """The latest complete checkpoint (continue with resume=True; export(run_dir, step=N) its weights)."""
    stopped_by: str = ""
    """Who stopped the run before train.steps: a callback's name, a signal's; empty when it ran to the end."""


@dataclass(frozen=True)
class SFTResult:
    """An `sft` run."""

    run_dir: Path
    final_model: Path
    """final/: the SFT'd model and its tokenizer (an HF folder)."""
    losses: list[float] = field(default_factory=list)
    """The training loss of each step."""


@dataclass(frozen=True)
class RMResult:
    """A `train_rm` run: a reward model folder (usable as rewards: [{name: reward_model, kwargs: {path: ...}}])."""

    path: Path
    info: dict[str, Any] = field(default_factory=dict)
    """grpolab_rm.json: held-out pair accuracy and margin, score statistics, calibration, options."""

    @property
    def heldout_accuracy(self) -> float | None:
        return self.info.get("heldout_accuracy")


@dataclass(frozen=True)
class EvalResult:
    """An `evaluate` run: held-out prompts scored by the config's rewards."""

    metrics: dict[str, Any]
    """The whole result, as `grpolab eval --out` writes it (greedy, sampled, examples, ...)."""

    @property
    def greedy(self) -> dict[str, float]:
        return self.metrics.get("greedy", {})

    @property
    def sampled(self) -> dict[str, float]:
        return self.metrics.get("sampled", {})


@dataclass(frozen=True)
class PipelineResult:
    """A `pipeline` run."""

    out_dir: Path
    payload: dict[str, Any]
    """The pipeline's eval.json payload (π0 and the final policy, each stage's figures)."""
