"""Per-token estimators of KL(π || π_ref), and the per-sequence KL of a reward penalty.

Shapes: N sequences, L completion positions; `loss_mask` [N, L] bool, True = this token counts.
Every estimator takes (logp [N, L], ref_logp [N, L]) -> [N, L], estimates KL(π || π_ref) from
samples of π, and is 0 where π == π_ref. The config's loss.kl_estimator is a key of KL_ESTIMATORS.
Pure tensor functions (no config, no .item()).
"""

from __future__ import annotations

from typing import Callable

import torch

# log(pi/pi_old) and log(ref/pi) are clamped to ±LOG_RATIO_CLAMP before exp (verl clamps the
# log-ratio at ±20 the same way): exp(20) ≈ 4.9e8 is finite in fp32 and far beyond any clip range.
LOG_RATIO_CLAMP = 20.0

# verl's low_var_kl clamps the k3 value to [-KL_VALUE_CLAMP, KL_VALUE_CLAMP] (core_algos.kl_penalty_forward).
KL_VALUE_CLAMP = 10.0


def _log_ref_ratio(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """d = log π_ref - log π, clamped to ±LOG_RATIO_CLAMP. [N, L], [N, L] -> [N, L]."""
    return (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """log π - log π_ref: unbiased, can be negative (verl's "kl" / "k1"). [N, L], [N, L] -> [N, L]."""
    return -_log_ref_ratio(logp, ref_logp)


def kl_abs(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """|log π - log π_ref|: biased, ≥ 0 (verl's kl_penalty "abs"). [N, L], [N, L] -> [N, L].

    verl (core_algos.kl_penalty_forward) takes the absolute log-ratio unclamped; here, like every
    estimator of this table, the log-ratio is clamped to ±LOG_RATIO_CLAMP first (no gradient beyond).
    """
    return _log_ref_ratio(logp, ref_logp).abs()


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """(log π_ref - log π)² / 2: biased, ≥ 0, low variance. [N, L], [N, L] -> [N, L]."""
    d = _log_ref_ratio(logp, ref_logp)
    return 0.5 * d * d


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """exp(d) - d - 1 with d = log π_ref - log π: unbiased, ≥ 0, unclamped (GRPO's; TRL's). [N, L], [N, L] -> [N, L]."""
    d = _log_ref_ratio(logp, ref_logp)
    return torch.exp(d) - d - 1.0


def kl_low_var(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 clamped to [-10, 10] (verl's kl_penalty "low_var_kl", which verl also calls "k3"). [N, L], [N, L] -> [N, L].

    verl (core_algos.kl_penalty_forward) clamps d = log π_ref - log π to ±20, then the value
    exp(d) - d - 1 to ±KL_VALUE_CLAMP "for numerical stability": a token whose estimate exceeds 10
    (d > 2.61 or d < -11) adds 10 and no gradient. k3 itself is ≥ 0, so only the upper bound acts.
    """
    return kl_k3(logp, ref_logp).clamp(-KL_VALUE_CLAMP, KL_VALUE_CLAMP)


KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# The config's loss.kl_estimator is a key of this table.
KL_ESTIMATORS: dict[str, KLEstimator] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    "abs": kl_abs,
    "low_var_kl": kl_low_var,
}


def _lookup(table: dict, name: str, field: str):
    """table[name], or ValueError naming the field and the known names."""
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"{field} must be one of {tuple(table)}, got {name!r}") from None


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π || π_ref) from samples of π: KL_ESTIMATORS[estimator].

    logp, ref_logp: [N, L]. Returns: [N, L]; all estimators are 0 where π == π_ref.
    To correct for samples drawn from π_old rather than π, multiply by the ratio π/π_old.
    """
    return _lookup(KL_ESTIMATORS, estimator, "kl_estimator")(logp, ref_logp)


def sequence_kl(logp: torch.Tensor, ref_logp: torch.Tensor, loss_mask: torch.Tensor,
                estimator: KLEstimator = kl_k1) -> torch.Tensor:
    """Each completion's KL estimate summed over its counted tokens: Σ_t est(logp, ref_logp)_t · mask_t.

    logp, ref_logp: [N, L] (for a reward penalty: log π_old and log π_ref of the sampled tokens);
    loss_mask: [N, L] bool; estimator: an entry of KL_ESTIMATORS. Returns [N] in logp's dtype.
    This is verl's KL-in-reward (ray_trainer.apply_kl_penalty with algorithm.use_kl_in_reward):
    token rewards r_t - β·kl_t, which its outcome advantages (GRPO, RLOO, ...) sum over the
    completion, so the sequence reward becomes r - β·sequence_kl.
    """
    assert logp.shape == ref_logp.shape == loss_mask.shape, (logp.shape, ref_logp.shape, loss_mask.shape)
    return (estimator(logp, ref_logp) * loss_mask.to(logp.dtype)).sum(-1)


def kl_reward_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, kl_coef: float,
                      estimator: KLEstimator = kl_k1) -> tuple[torch.Tensor, torch.Tensor]:
    """The KL penalty of the rewards (loss.kl_in_reward), per sequence and per token: β·KL(π_old ‖ π_ref).

    logp, ref_logp: [N, L] log π_old and log π_ref of the sampled tokens; mask: [N, L] bool, True =
    this token counts; kl_coef: β; estimator: an entry of KL_ESTIMATORS. Returns
    (per_sequence [N] = β · Σ_t est_t · mask_t, what GRPO subtracts from each completion's reward;
    per_token [N, L] = β · est_t on the counted tokens, 0 elsewhere, what PPO subtracts from its token
    rewards, `algo.value.token_rewards`), both in logp's dtype.
    """
    kl = estimator(logp, ref_logp)
    per_sequence = kl_coef * sequence_kl(logp, ref_logp, mask, estimator)
    per_token = kl_coef * torch.where(mask, kl, torch.zeros_like(kl))
    return per_sequence, per_token
