"""metrics.jsonl writing and reading, TensorBoard / Weights & Biases mirroring, FLOP helpers.

The JSON-lines file is the source of truth: one object per GRPO step, appended and flushed on
every `log` call so that a crash loses nothing already logged. Non-finite floats become `null`
(NaN and Infinity are not valid JSON). TensorBoard and W&B get the same numeric scalars.
"""

from __future__ import annotations

import json
import math
import numbers
from pathlib import Path
from typing import Any, Iterator

METRICS_FILE = "metrics.jsonl"


def _plain(value: Any) -> Any:
    """A JSON-ready copy of one value: 0-d tensors/numpy scalars unwrapped, non-finite -> None."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0 and not isinstance(value, str):
        value = value.item()
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    raise TypeError(f"metrics: value of type {type(value).__name__} is not JSON-serialisable: "
                    f"{value!r}")


class MetricsLogger:
    """Appends one JSON line per `log(row)` to `run_dir/metrics.jsonl` and mirrors the scalars.

    tensorboard: write events to `run_dir/tb/` with torch.utils.tensorboard.SummaryWriter.
    wandb: also `wandb.log` (wandb.init(project=wandb_project, dir=run_dir)); needs
        `pip install wandb`.
    """

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True, wandb: bool = False,
                 wandb_project: str | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self._tb = None
        self._wandb = None
        if wandb:
            try:
                import wandb as wandb_mod
            except ImportError as e:
                raise ImportError("metrics: wandb logging was asked for but the wandb package is "
                                  "not installed: pip install wandb") from e
            self._wandb = wandb_mod.init(project=wandb_project, dir=str(self.run_dir))
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError("metrics: tensorboard=True needs the tensorboard package: "
                                  "pip install tensorboard (or pass tensorboard=False)") from e

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"))
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, row: dict[str, Any]) -> dict[str, Any]:
        """Writes one step's metrics; returns the row as written (non-finite floats -> None).

        row must hold an integer "step"; values are numbers, bools, strings, None, or
        nested lists/dicts of those (0-d tensors and numpy scalars are unwrapped).
        """
        if not isinstance(row, dict):
            raise TypeError(f"metrics: log() takes a dict, got {type(row).__name__}")
        clean = _plain(row)
        step = clean.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"metrics: row needs an integer 'step', got {row.get('step')!r}")
        self._file.write(json.dumps(clean, allow_nan=False, ensure_ascii=False) + "\n")
        self._file.flush()
        scalars = {k: v for k, v in clean.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        return clean

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yields (line_number, object) for each non-blank line; a bad line raises ValueError
    naming `file:line`, except a last line cut short (no newline: a run killed while writing it),
    which is left out."""
    path = Path(path)
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                if not line.endswith("\n"):  # only the last line can lack its newline
                    return

                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno}): "
                                 f"{line.strip()[:120]}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got "
                                 f"{type(obj).__name__}")
            yield lineno, obj


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a metrics.jsonl (a run dir is accepted too), in file order.

    A row that is not a JSON object or lacks an integer "step" raises ValueError with file:line.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    rows = []
    for lineno, obj in iter_jsonl(path):
        step = obj.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"{path}:{lineno}: 'step' must be an integer, got {step!r}")
        rows.append(obj)
    return rows


def model_flops_per_token(n_params: int, *, backward: bool, n_layers: int = 0,
                          d_model: int = 0, context_len: int = 0) -> float:
    """Model FLOPs for one token of a dense decoder-only transformer (PaLM appendix B convention).

    Counted: one multiply-add = 2 FLOPs, matrix multiplications only.
      - weights: 2·N per token forward (every parameter takes part in one multiply-add);
      - attention scores and the weighted sum of values: 2·2·n_layers·d_model·context_len per
        token forward (QKᵀ and AV over the full context_len, no causal halving). Pass
        n_layers = d_model = context_len = 0 (the default) to ignore attention;
      - backward = True counts forward + backward as 3× forward (6·N + 12·n_layers·d_model·T);
        backward = False counts the forward only (2·N + 4·n_layers·d_model·T), as for
        generation and log-prob passes.
    Not counted: softmax, norms, activations, embedding lookups, optimizer updates, and any
    recomputation (activation checkpointing), so this is *model* FLOPs, not hardware FLOPs.
    n_params is the caller's choice: for a tied embedding/LM head pass the total parameter
    count (the LM head is a matmul); otherwise non-embedding parameters + the LM head.
    """
    if n_params < 0 or n_layers < 0 or d_model < 0 or context_len < 0:
        raise ValueError("model_flops_per_token: sizes must be >= 0, got "
                         f"n_params={n_params} n_layers={n_layers} d_model={d_model} "
                         f"context_len={context_len}")
    forward = 2.0 * n_params + 4.0 * n_layers * d_model * context_len
    return 3.0 * forward if backward else forward


def mfu(flops_per_s: float, peak_flops: float) -> float:
    """Model FLOP utilisation: achieved model FLOP/s ÷ the hardware's peak FLOP/s (a fraction).

    flops_per_s = model_flops_per_token(...) × tokens per second; peak_flops in FLOP/s for the
    dtype used (e.g. 989e12 for an H100 SXM in bf16 dense).
    """
    if not (math.isfinite(peak_flops) and peak_flops > 0):
        raise ValueError(f"mfu: peak_flops must be a positive FLOP/s value, got {peak_flops!r}")
    if not flops_per_s >= 0:
        raise ValueError(f"mfu: flops_per_s must be >= 0, got {flops_per_s!r}")
    return flops_per_s / peak_flops
