"""Reward-model ensembles against over-optimization (Coste et al. 2023, "Reward model ensembles help
mitigate overoptimization"): K reward models score each completion; the reward is their mean, the
worst member (WCO: min), or the mean less λ times their spread (uncertainty-weighted). Pure functions
on [K, N] scores (K members, N completions), chosen by name from `ENSEMBLES` once at setup.
"""

from __future__ import annotations

from typing import Callable

import torch


def ensemble_mean(scores: torch.Tensor, lam: float = 0.0) -> torch.Tensor:
    """Mean over the members. [K, N] -> [N]."""
    return scores.mean(0)


def ensemble_min(scores: torch.Tensor, lam: float = 0.0) -> torch.Tensor:
    """Worst-case optimization: the lowest member's score. [K, N] -> [N]."""
    return scores.min(0).values


def ensemble_mean_minus_std(scores: torch.Tensor, lam: float = 1.0) -> torch.Tensor:
    """Uncertainty-weighted: mean − λ · std over the members (population std, so one member gives the
    mean). [K, N] -> [N]."""
    return scores.mean(0) - lam * scores.std(0, correction=0)


def ensemble_mean_minus_var(scores: torch.Tensor, lam: float = 1.0) -> torch.Tensor:
    """Coste et al.'s uncertainty-weighted optimization: mean − λ · variance over the members. [K, N] -> [N]."""
    return scores.mean(0) - lam * scores.var(0, correction=0)


ENSEMBLES: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "mean": ensemble_mean,
    "min": ensemble_min,
    "mean_minus_std": ensemble_mean_minus_std,
    "mean_minus_var": ensemble_mean_minus_var,
}
"""Ensemble mode -> (scores [K, N], λ) -> rewards [N]."""
