"""Process (token-level) reward models: a score per step, each step labelled right or wrong
(Lightman et al. 2023, "Let's verify step by step"); the sequence's score is its weakest step.

A step is one completion token (EOS included). A step is right when the completion up to and
including it is a prefix of the target (the gold completion plus EOS): every step after the first
wrong one is wrong, and a completion that stops early (EOS where the target has more) or runs on is
wrong at that step. Pure functions on tensors; rows are right-padded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def prefix_step_labels(ids: torch.Tensor, target_ids: torch.Tensor, step_mask: torch.Tensor) -> torch.Tensor:
    """[N, T] bool: True at the steps whose completion so far is a prefix of the target.

    ids: [N, T] the scored sequence (prompt + completion + EOS); target_ids: [N, T] prompt + target +
    EOS aligned with it (the same prompt), any id that matches nothing (e.g. -1) past its end;
    step_mask: [N, T] True at the completion's steps. Positions outside step_mask are False."""
    steps = step_mask.bool()
    same = (ids == target_ids) | ~steps  # only the steps are compared
    return (same.int().cumprod(dim=1) > 0) & steps


def process_scores(step_scores: torch.Tensor, step_mask: torch.Tensor) -> torch.Tensor:
    """[N]: the minimum of each row's step scores over its steps (its weakest step); 0 for a row
    without steps. step_scores: [N, T] float; step_mask: [N, T] bool."""
    steps = step_mask.bool()
    worst = step_scores.masked_fill(~steps, float("inf")).amin(dim=1)
    return torch.where(steps.any(dim=1), worst, torch.zeros_like(worst))


def process_step_loss(step_scores: torch.Tensor, labels: torch.Tensor, step_mask: torch.Tensor) -> torch.Tensor:
    """[N]: each row's mean binary cross-entropy (logits `step_scores`, targets `labels`) over its
    steps; 0 for a row without steps. Sum and divide by the batch's row count."""
    steps = step_mask.bool()
    bce = F.binary_cross_entropy_with_logits(step_scores.float(), labels.float(), reduction="none")
    n = steps.sum(dim=1)
    return torch.where(n > 0, (bce * steps).sum(dim=1) / n.clamp(min=1), torch.zeros_like(bce[:, 0]))


def generative_step_loss(step_logp: torch.Tensor, labels: torch.Tensor, step_mask: torch.Tensor) -> torch.Tensor:
    """[N]: each row's mean over its steps of −log p at a right step and −log(1 − p) at a wrong one,
    p = exp(step_logp) the step token's probability under a language model (a generative process
    RM: its step score is log p). step_logp: [N, T] (≤ 0); labels, step_mask: [N, T] bool."""
    steps = step_mask.bool()
    logp = step_logp.float().clamp(max=-1e-6)  # log(1 − p) needs p < 1
    per = torch.where(labels.bool(), -logp, -torch.log(-torch.expm1(logp)))
    n = steps.sum(dim=1)
    return torch.where(n > 0, (per * steps).sum(dim=1) / n.clamp(min=1), torch.zeros_like(per[:, 0]))
