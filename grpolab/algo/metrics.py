"""Metrics of scored completions: NaN-aware mean, the verifier's per-row correctness, a reward's
pair accuracy against the gold. Pure tensor functions."""

from __future__ import annotations

import math
from typing import Sequence

import torch


def nanmean(x: torch.Tensor) -> float:
    """The mean of the non-NaN entries (NaN when there is none)."""
    x = x[~torch.isnan(x)]
    return float(x.mean()) if x.numel() else float("nan")


def correct_rows(scores: dict[str, torch.Tensor], verifiers: Sequence[str]) -> torch.Tensor | None:
    """[N] 1.0 / 0.0 where the first verifier reward (in `verifiers`' order) that scored a row
    scored 1.0 / less, NaN where it abstained; None when no verifier scored any row. Its nanmean is
    the `accuracy` metric."""
    for name in verifiers:
        sc = scores.get(name)
        if sc is not None and (~torch.isnan(sc)).any():
            return (sc == 1.0).float().masked_fill(torch.isnan(sc), math.nan)
    return None


def pair_accuracy(scores: torch.Tensor, correct: torch.Tensor, group_size: int) -> float:
    """How often a reward ranks a correct completion above a wrong one of the same prompt: over every
    pair (i, j) within a group where the gold prefers i (correct_i > correct_j: with 1.0 / 0.0, a
    correct and a wrong one), the share where i scores higher (ties 1/2). The pair accuracy of a
    proxy reward on the policy's own samples, against the gold `correct` (Gao et al. 2022 read
    over-optimization from it). scores, correct: [N] (NaN = not scored / abstained; such rows are
    left out). NaN when no group has a pair the gold tells apart."""
    sc, ok = scores.view(-1, group_size).float(), correct.view(-1, group_size).float()
    valid = ~torch.isnan(sc) & ~torch.isnan(ok)
    both = valid.unsqueeze(2) & valid.unsqueeze(1)
    pairs = both & (ok.unsqueeze(2) > ok.unsqueeze(1))  # [P, G, G]: (i preferred, j not)
    diff = sc.unsqueeze(2) - sc.unsqueeze(1)
    wins = torch.where(diff > 0, 1.0, torch.where(diff == 0, 0.5, 0.0))
    n = pairs.sum()
    return float((wins * pairs).sum() / n) if n > 0 else math.nan
