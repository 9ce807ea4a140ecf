"""Advantages from grouped rewards: rewards [P, G] -> advantages [P, G].

P prompts, G completions per prompt (a "group"). Pure tensor functions, no config.

NaN rewards mean "every reward function abstained on this row" (see rewards/base.py `combine`).
Such a row is left out of its group's statistics (mean, std, leave-one-out baseline) and gets
advantage 0, so it contributes no gradient. A group with fewer than two scored rows, or whose
scored rewards are all equal, gets advantage 0 (never NaN).

Statistics are group-local, so data-parallel ranks (each holding whole groups) agree without
talking, except loss.std="batch", whose std is over the whole batch: advantage functions take a
`reduce` argument (the sum over ranks; identity in one process) that only batch statistics use.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

Reduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor over the data-parallel ranks (e.g. `parallel.parallel.Parallel.all_reduce_sum`)."""


def no_reduce(x: torch.Tensor) -> torch.Tensor:
    """The `Reduce` of one process: x itself."""
    return x


AdvantageFn = Callable[..., torch.Tensor]
"""(rewards [P, G] (NaN = abstained), reduce: Reduce = no_reduce) -> advantages [P, G]."""


@dataclass(frozen=True)
class StdMode:
    """How group_norm scales the centred rewards. divisor: count of scored rows [P, 1] -> the
    divisor of the group's sum of squared deviations; None = no scaling (mean-centring only).
    batch: the scale is `batch_std`, the sample std of all the batch's scored rewards (every
    rank's groups), instead of each group's own std."""

    divisor: Callable[[torch.Tensor], torch.Tensor] | None
    doc: str
    batch: bool = False


# The config's loss.std is a key of this table.
STD_MODES: dict[str, StdMode] = {
    "population": StdMode(lambda count: count, "population std, divide by n (the reward-normalization table's)"),
    "sample": StdMode(lambda count: count - 1, "sample std, divide by n - 1 (TRL and verl)"),
    "none": StdMode(None, "no scaling: mean-centring only (Dr. GRPO)"),
    "batch": StdMode(lambda count: count - 1,
                     "r - group mean, over the sample std of all the batch's rewards (TRL scale_rewards=batch)",
                     batch=True),
}


def _lookup(table: dict, name: str, field: str):
    """table[name], or ValueError naming the field and the known names."""
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"{field} must be one of {tuple(table)}, got {name!r}") from None


def _check(rewards: torch.Tensor) -> None:
    assert rewards.dim() == 2, f"rewards must be [P, G], got shape {tuple(rewards.shape)}"


def _masked_stats(rewards: torch.Tensor):
    """Returns (valid [P,G] bool, filled [P,G] with NaN→0, count [P,1], mean [P,1])."""
    valid = ~torch.isnan(rewards)
    filled = torch.where(valid, rewards, torch.zeros_like(rewards))
    count = valid.sum(dim=1, keepdim=True).to(rewards.dtype)
    mean = filled.sum(dim=1, keepdim=True) / count.clamp(min=1)
    return valid, filled, count, mean


def _std(valid, filled, count, mean, divisor) -> torch.Tensor:
    """[P, 1] std from `_masked_stats`; 0 for groups with fewer than 2 scored rows."""
    sq = torch.where(valid, (filled - mean) ** 2, torch.zeros_like(filled)).sum(dim=1, keepdim=True)
    var = sq / divisor(count).clamp(min=1)
    return torch.where(count >= 2, var.sqrt(), torch.zeros_like(var))


def batch_std(rewards: torch.Tensor, reduce: Reduce = no_reduce) -> torch.Tensor:
    """Sample std (divide by n - 1) of every scored reward of the batch, about the batch mean.

    rewards: [P, G] float, NaN = abstained: this rank's groups. reduce: sums a tensor over the
    data-parallel ranks, so the std is the whole batch's whatever the world size (two float64
    reductions: the count and sum, then the squared deviations from the batch mean, which is
    stabler than one reduction of the sum of squares). Returns: [1, 1] in rewards' dtype; 0 with
    fewer than two scored rewards in the batch. TRL: nanstd(rewards) for scale_rewards="batch".
    """
    _check(rewards)
    valid = ~torch.isnan(rewards)
    x = torch.where(valid, rewards, torch.zeros_like(rewards)).double()
    count, total = reduce(torch.stack([valid.sum().double(), x.sum()])).unbind()
    mean = total / count.clamp(min=1)
    sq = reduce(torch.where(valid, (x - mean) ** 2, torch.zeros_like(x)).sum())
    var = sq / (count - 1).clamp(min=1)
    sd = torch.where(count >= 2, var.sqrt(), torch.zeros_like(var))
    return sd.to(rewards.dtype).view(1, 1)


def group_std(rewards: torch.Tensor, std: str = "population", reduce: Reduce = no_reduce) -> torch.Tensor:
    """Per-group standard deviation ignoring NaN rows; with std="batch" the batch's, for every group.

    rewards: [P, G]. std: a key of STD_MODES that scales ("population": divide by n, "sample": by
    n - 1, "batch": `batch_std`). reduce: the sum over ranks (read by "batch" only).
    Returns: [P, 1]; 0 for groups with fewer than 2 scored rows ("batch": 0 everywhere when the
    batch has fewer than 2).
    """
    _check(rewards)
    mode = _lookup(STD_MODES, std, "std")
    if mode.divisor is None:
        raise ValueError(f"group_std needs a std mode that scales, got {std!r}")
    if mode.batch:
        return batch_std(rewards, reduce).expand(rewards.shape[0], 1)
    return _std(*_masked_stats(rewards), mode.divisor)


def _normalize(rewards: torch.Tensor, divisor: Callable[[torch.Tensor], torch.Tensor] | None, eps: float) -> torch.Tensor:
    """group_normalize with a group-local std mode already looked up (divisor None = mean-centring only)."""
    _check(rewards)
    valid, filled, count, mean = _masked_stats(rewards)
    centred = filled - mean
    if divisor is not None:
        sd = _std(valid, filled, count, mean, divisor)
        # equal rewards: centred is exactly 0; dividing by (0 + eps) with eps = 0 would give NaN
        centred = torch.where(sd > 0, centred / (sd + eps), torch.zeros_like(centred))
    ok = valid & (count >= 2)
    return torch.where(ok, centred, torch.zeros_like(centred))


def batch_normalize(rewards: torch.Tensor, eps: float = 1e-6, reduce: Reduce = no_reduce) -> torch.Tensor:
    """TRL's scale_rewards="batch" (the PPO-Lite recipe, arXiv 2508.08221): (r - group mean) / (batch std + eps).

    rewards: [P, G] float, NaN = abstained; reduce: the sum over data-parallel ranks (`batch_std`).
    Centred per group, as TRL; scaled by the sample std of all the batch's scored rewards about
    the batch mean (TRL's nanstd(rewards)), the same on every rank.
    Returns: [P, G]; 0 for NaN rows, groups with fewer than two scored rows, and equal rewards.
    """
    _check(rewards)
    valid, filled, count, mean = _masked_stats(rewards)
    sd = batch_std(rewards, reduce)
    centred = torch.where(sd > 0, (filled - mean) / (sd + eps), torch.zeros_like(filled))
    return torch.where(valid & (count >= 2), centred, torch.zeros_like(centred))


def group_normalize(rewards: torch.Tensor, std: str = "population", eps: float = 1e-6,
                    reduce: Reduce = no_reduce) -> torch.Tensor:
    """GRPO advantage: (r - mean_group) / (std_group + eps); std="batch": `batch_normalize`.

    rewards: [P, G] float, NaN = abstained. std: a key of STD_MODES. reduce: the sum over ranks
    (read by "batch" only). Returns: [P, G]; 0 for NaN rows, degenerate groups and groups whose
    rewards are all equal.
    """
    return _group_norm(std, eps)(rewards, reduce)


def _group_local(fn: Callable[[torch.Tensor], torch.Tensor]) -> AdvantageFn:
    """An AdvantageFn of a function whose statistics are group-local: it has nothing to reduce."""
    def advantages(rewards: torch.Tensor, reduce: Reduce = no_reduce) -> torch.Tensor:
        return fn(rewards)
    return advantages


def _group_norm(std: str, eps: float) -> AdvantageFn:
    """The group_norm AdvantageFn of a std mode: `batch_normalize`, or `_normalize` on group statistics."""
    mode = _lookup(STD_MODES, std, "std")
    if not mode.batch:
        return _group_local(partial(_normalize, divisor=mode.divisor, eps=eps))

    def advantages(rewards: torch.Tensor, reduce: Reduce = no_reduce) -> torch.Tensor:
        return batch_normalize(rewards, eps, reduce)
    return advantages


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


@dataclass(frozen=True)
class AdvantageEstimator:
    """A factory of advantage functions: `estimator(std, eps)` -> (rewards [P, G], reduce) -> advantages [P, G].

    build: (std, eps) -> AdvantageFn (std is a key of STD_MODES; estimators that do not scale
    ignore std and eps; only batch statistics read `reduce`). needs_group: the estimator compares completions within a group, so
    rollout.group_size must be at least 2. doc: the line the config reference prints.
    """

    build: Callable[[str, float], AdvantageFn]
    needs_group: bool
    doc: str

    def __call__(self, std: str = "population", eps: float = 1e-6) -> AdvantageFn:
        return self.build(std, eps)


# The config's loss.advantage is a key of this table.
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "group_norm": AdvantageEstimator(_group_norm, True,
                                     "(r - group mean) / (group std + loss.std_eps), std per loss.std (GRPO)"),
    "rloo": AdvantageEstimator(lambda std, eps: _group_local(leave_one_out), True,
                               "r - mean of the group's other scored rewards (RLOO)"),
    "reinforce": AdvantageEstimator(lambda std, eps: _group_local(raw_rewards), False, "the raw reward r (REINFORCE)"),
    "relu": AdvantageEstimator(lambda std, eps: _group_local(relu_rewards), False,
                               "ReLU(r): wrong answers are dropped (rejection sampling / on-policy SFT)"),
    # PPO: the [P, G] stage is r itself; grpo/critic.py puts it on each completion's last token and
    # runs GAE over a value head's V_old (algo/value.py), giving per-token advantages.
    "gae": AdvantageEstimator(lambda std, eps: _group_local(raw_rewards), False,
                              "per-token GAE over a value head's values, whitened over the batch (PPO; verl's gae)"),
}


VALUE_BASED = frozenset({"gae"})
"""Estimators that read a value head's values (the run builds a critic, grpo/critic.py); their
advantages are per token."""


def make_advantage_fn(kind: str, std: str = "population", eps: float = 1e-6) -> AdvantageFn:
    """Chooses the advantage estimator once at setup: ADVANTAGE_ESTIMATORS[kind](std, eps)."""
    return _lookup(ADVANTAGE_ESTIMATORS, kind, "advantage")(std, eps)
