"""Calibrating a reward model's scores into probabilities: P(good | s) = σ(a·s + b), fitted by
logistic regression (Newton's method) on scores whose labels are known, e.g. the chosen (1) and the
rejected (0) completions of preference pairs. Pure functions on tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fit_logistic(scores: torch.Tensor, labels: torch.Tensor, steps: int = 50, l2: float = 1e-3) -> torch.Tensor:
    """[2] (a, b) minimizing Σ −log σ(±(a·s + b)) + l2·N·a²/2 over `scores` [N] with `labels` [N]
    (1 / 0): `steps` Newton steps from (1, 0), each halved until the objective does not rise. The
    ridge keeps `a` finite when the scores separate the labels."""
    x = torch.stack([scores.double(), torch.ones_like(scores, dtype=torch.float64)], dim=1)  # [N, 2]
    y = labels.double()
    ridge = torch.diag(torch.tensor([l2, 1e-9], dtype=torch.float64)) * len(y)

    def objective(w: torch.Tensor) -> torch.Tensor:
        z = x @ w
        return -(y * F.logsigmoid(z) + (1 - y) * F.logsigmoid(-z)).sum() + 0.5 * w @ ridge @ w

    w = torch.tensor([1.0, 0.0], dtype=torch.float64)
    for _ in range(steps):
        p = torch.sigmoid(x @ w)
        grad = x.T @ (p - y) + ridge @ w
        hess = (x * (p * (1 - p)).unsqueeze(1)).T @ x + ridge
        step, f0 = torch.linalg.solve(hess, grad), objective(w)
        for _ in range(30):  # backtracking: a full Newton step can overshoot on nearly separable scores
            if objective(w - step) <= f0:
                break
            step = step / 2
        w = w - step
    return w.float()


def calibrated(scores: torch.Tensor, ab: torch.Tensor) -> torch.Tensor:
    """σ(a·s + b): [N] probabilities from scores [N] and the fitted (a, b) [2]."""
    return torch.sigmoid(ab[0] * scores + ab[1])
