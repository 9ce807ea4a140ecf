"""The optimizer (AdamW) and the learning-rate schedules shared by GRPO, SFT and reward-model training.

Kept here, below the trainers (grpo/, sft/, reward_models/), so that every trainer can use them
without importing another trainer's set-up module. LR_SCHEDULES is the registry of train.lr_schedule.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

FUSED_ADAMW_DEVICES = ("cpu", "cuda")


def adamw(params: Iterable[torch.nn.Parameter], *, lr: float, weight_decay: float = 0.0,
          betas: tuple[float, float] = (0.9, 0.999)) -> torch.optim.AdamW:
    """torch's AdamW, with its fused kernel when every parameter is a float tensor on a CPU or CUDA
    device (what transformers' Trainer picks by default since torch 2.8), else torch's default one.
    The fused kernel is several times faster on a CPU; the update is the same to float rounding."""
    params = list(params)
    fused = bool(params) and all(p.is_floating_point() and p.device.type in FUSED_ADAMW_DEVICES for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, fused=fused or None)


def _constant(frac: float) -> float:
    """No decay after the warm-up."""
    return 1.0


def _cosine(frac: float) -> float:
    """Half a cosine from 1 down to 0 over the steps after the warm-up."""
    return 0.5 * (1 + math.cos(math.pi * frac))


def _linear(frac: float) -> float:
    """A straight line from 1 down to 0 over the steps after the warm-up."""
    return 1.0 - frac


# The config's train.lr_schedule is a key of this table: the LR multiplier after warm-up as a
# function of the fraction of post-warm-up steps done, frac in [0, 1].
LR_SCHEDULES: dict[str, Callable[[float], float]] = {
    "constant": _constant,
    "cosine": _cosine,
    "linear": _linear,
}


def lr_lambda(schedule: str, warmup: int, total: int) -> Callable[[int], float]:
    """LambdaLR's multiplier for optimizer step i: linear warm-up over `warmup` steps, then
    LR_SCHEDULES[schedule] over the remaining `total - warmup` steps."""
    try:
        decay = LR_SCHEDULES[schedule]
    except KeyError:
        raise ValueError(f"lr_schedule must be one of {tuple(LR_SCHEDULES)}, got {schedule!r}") from None

    def f(i: int) -> float:
        if warmup and i < warmup:
            return (i + 1) / warmup
        return decay(min(1.0, (i - warmup) / max(1, total - warmup)))

    return f
