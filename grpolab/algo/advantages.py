"""Advantages from grouped rewards: rewards [P, G] -> advantages [P, G].

P prompts, G completions per prompt (a "group"). Pure tensor functions, no config.

NaN rewards mean "every reward function abstained on this row" (see rewards/base.py `combine`).
Such a row is left out of its group's statistics (mean, std, leave-one-out baseline) and gets
advantage 0, so it contributes no gradient. A group with fewer than two scored rows, or whose
scored rewards are all equal, gets advantage 0 (never NaN).
"""

from __future__ import annotations

from typing import Callable

import torch

STD_MODES = ("population", "sample", "none")


def _check(rewards: torch.Tensor) -> None:
    assert rewards.dim() == 2, f"rewards must be [P, G], got shape {tuple(rewards.shape)}"


def _masked_stats(rewards: torch.Tensor):
    """Returns (valid [P,G] bool, filled [P,G] with NaN→0, count [P,1], mean [P,1])."""
    valid = ~torch.isnan(rewards)
    filled = torch.where(valid, rewards, torch.zeros_like(rewards))
    count = valid.sum(dim=1, keepdim=True).to(rewards.dtype)
    mean = filled.sum(dim=1, keepdim=True) / count.clamp(min=1)
    return valid, filled, count, mean


def group_std(rewards: torch.Tensor, std: str = "population") -> torch.Tensor:
    """Per-group standard deviation ignoring NaN rows.

    rewards: [P, G]. std: "population" (divide by n) or "sample" (divide by n - 1).
    Returns: [P, 1]; 0 for groups with fewer than 2 scored rows.
    """
    _check(rewards)
    valid, filled, count, mean = _masked_stats(rewards)
    sq = torch.where(valid, (filled - mean) ** 2, torch.zeros_like(filled)).sum(dim=1, keepdim=True)
    denom = count if std == "population" else count - 1
    var = sq / denom.clamp(min=1)
    return torch.where(count >= 2, var.sqrt(), torch.zeros_like(var))


def group_normalize(rewards: torch.Tensor, std: str = "population", eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantage: (r - mean_group) / (std_group + eps).

    rewards: [P, G] float, NaN = abstained.
    std: "population" (the seed-004 table; divide by n), "sample" (TRL and verl; divide by n - 1),
         or "none" (Dr. GRPO: mean-centring only).
    Returns: [P, G]; 0 for NaN rows, degenerate groups and groups whose rewards are all equal.
    """
    _check(rewards)
    if std not in STD_MODES:
        raise ValueError(f"std must be one of {STD_MODES}, got {std!r}")
    valid, filled, count, mean = _masked_stats(rewards)
    centred = filled - mean
    if std != "none":
        sd = group_std(rewards, std)
        # equal rewards: centred is exactly 0; dividing by (0 + eps) with eps = 0 would give NaN
        centred = torch.where(sd > 0, centred / (sd + eps), torch.zeros_like(centred))
    ok = valid & (count >= 2)
    return torch.where(ok, centred, torch.zeros_like(centred))


def leave_one_out(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO advantage: r_i - mean_{j != i} r_j over the scored rows of the group.

    rewards: [P, G], NaN = abstained. Returns: [P, G]; 0 where fewer than two rows are scored.
    """
    _check(rewards)
    valid, filled, count, _ = _masked_stats(rewards)
    total = filled.sum(dim=1, keepdim=True)
    baseline = (total - filled) / (count - 1).clamp(min=1)
    adv = filled - baseline
    ok = valid & (count >= 2)
    return torch.where(ok, adv, torch.zeros_like(adv))


def raw_rewards(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE weights: the reward itself (negative rewards push probability down). [P,G]->[P,G]."""
    _check(rewards)
    return torch.nan_to_num(rewards, nan=0.0)


def relu_rewards(rewards: torch.Tensor) -> torch.Tensor:
    """On-policy SFT / rejection sampling weights: ReLU(r); wrong answers are dropped. [P,G]->[P,G]."""
    _check(rewards)
    return torch.nan_to_num(rewards, nan=0.0).clamp(min=0.0)


def zero_std_groups(rewards: torch.Tensor) -> torch.Tensor:
    """True for groups whose scored rewards are all equal (no learning signal). [P,G] -> [P] bool."""
    _check(rewards)
    valid, filled, count, mean = _masked_stats(rewards)
    spread = torch.where(valid, (filled - mean).abs(), torch.zeros_like(filled)).amax(dim=1)
    return (spread == 0) | (count.squeeze(1) < 2)


def make_advantage_fn(kind: str, std: str = "population", eps: float = 1e-6) -> Callable[[torch.Tensor], torch.Tensor]:
    """Chooses the advantage estimator once at setup. kind: group_norm | rloo | reinforce | relu."""
    table: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "group_norm": lambda r: group_normalize(r, std=std, eps=eps),
        "rloo": leave_one_out,
        "reinforce": raw_rewards,
        "relu": relu_rewards,
    }
    if kind not in table:
        raise ValueError(f"advantage must be one of {sorted(table)}, got {kind!r}")
    return table[kind]


ADVANTAGE_KINDS = ("group_norm", "rloo", "reinforce", "relu")
