"""Policy objectives, KL estimators, loss aggregation, SFT and reward-model losses.

Shapes: N sequences, L completion positions. `loss_mask` [N, L] bool, True = this token counts.
Per-token functions return [N, L] tensors; `aggregate` turns them into the scalar of one
microbatch, divided by a normalizer computed once for the whole minibatch (`agg_normalizer`), so
the gradient summed over microbatches (and data-parallel ranks) equals the whole minibatch's —
for every mode but TRL's bnpo, which divides each microbatch by its own token count on purpose
(`Aggregation.per_microbatch`).

The variants are registries, chosen once at setup by their config name: POLICY_LOSSES
(loss.policy_loss), KL_ESTIMATORS (loss.kl_estimator, in algo/kl.py), AGGREGATIONS (loss.loss_agg).
Adding a variant means adding one entry there; config validation and the config reference read the keys.

Statistics are returned as detached tensors; only the training loop calls `.item()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

# The KL estimators live in algo/kl.py (a loss term here, a reward penalty in the loop); re-exported.
from grpolab.algo.kl import (  # noqa: F401
    KL_ESTIMATORS,
    LOG_RATIO_CLAMP,
    kl_abs,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_low_var,
    kl_penalty,
    sequence_kl,
)


def importance_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """π/π_old per token = exp(logp - old_logp), log-ratio clamped to ±LOG_RATIO_CLAMP. [N, L] -> [N, L]."""
    return torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _stats(ratio: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"ratio": ratio.detach(), "clipped_low": low.detach(), "clipped_high": high.detach()}


def _clip_ratio(ratio, a, eps_low, eps_high, dual_clip):
    """-min(ρA, clip(ρ)A), optional dual clip; ratio [N,L], a [N,1]. Returns (loss, stats)."""
    unclipped = ratio * a
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * a
    loss = -torch.minimum(unclipped, clipped)
    if dual_clip is not None:
        # For A < 0 the loss -ρA grows without bound in ρ; dual clip caps it at -c·A (c > 1).
        loss = torch.where(a < 0, torch.minimum(loss, -dual_clip * a), loss)
    low = (ratio < 1.0 - eps_low) & (a < 0)
    high = (ratio > 1.0 + eps_high) & (a > 0)
    return loss, _stats(ratio, low, high)


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO token-level clipped surrogate: -min(ρA, clip(ρ, 1-ε_low, 1+ε_high)A).

    logp, old_logp: [N, L]; adv: [N]; loss_mask: [N, L] (unused here, kept for a common signature).
    ρ = exp(logp - old_logp), log-ratio clamped to ±LOG_RATIO_CLAMP.
    Returns: per-token loss [N, L], stats {ratio, clipped_low, clipped_high} each [N, L] detached.
    `clipped_low/high` mark tokens where the clip is active (zero gradient).
    """
    assert logp.shape == old_logp.shape and adv.shape == logp.shape[:1], (logp.shape, old_logp.shape, adv.shape)
    ratio = importance_ratio(logp, old_logp)
    return _clip_ratio(ratio, adv.unsqueeze(-1), eps_low, eps_high, dual_clip)


def sequence_clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: the clipped surrogate on the sequence-level ratio s_i = exp(mean_t log(π/π_old)).

    Per token the ratio is sg[s_i] · π/sg[π], which has value s_i and the GSPO gradient
    s_i · ∇ mean_t log π. Shapes as in `clipped_surrogate`; typical ε are ~1e-3 or smaller.
    """
    m = loss_mask.to(logp.dtype)
    seq_log_ratio = ((logp - old_logp) * m).sum(-1) / m.sum(-1).clamp(min=1)  # [N]
    seq_log_ratio = seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    log_ratio = logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    return _clip_ratio(ratio, adv.unsqueeze(-1), eps_low, eps_high, dual_clip)


def weighted_nll(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_low: float = 0.0,
    eps_high: float = 0.0,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """On-policy SFT / REINFORCE: -A · log π (no ratio, no clip). Shapes as `clipped_surrogate`.

    With A = ReLU(r) this is rejection-sampling SFT; with A = r it is REINFORCE. The ratio is
    still reported (detached) so the run logs how far π moved from π_old.
    """
    ratio = importance_ratio(logp.detach(), old_logp)
    loss = -adv.unsqueeze(-1) * logp
    none = torch.zeros_like(ratio, dtype=torch.bool)
    return loss, _stats(ratio, none, none)


def cispo(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    *,
    cispo_ratio_max: float = 5.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO, clipped IS-weight policy optimization (MiniMax-M1, arXiv 2506.13585), as TRL's
    GRPOTrainer defines loss_type="cispo": -sg(min(ρ, ε_max)) · A · log π per token, ρ = π/π_old.

    The importance weight is capped and detached, never the token: every token keeps the gradient
    -min(ρ, ε_max)·A·∇log π, where PPO's clip gives clipped tokens none. cispo_ratio_max is ε_max,
    an absolute cap on ρ (TRL's epsilon_high under loss_type="cispo"; ScaleRL recommends 5.0).
    There is no lower cap, as in TRL. Shapes as `clipped_surrogate`; eps_low, eps_high and
    dual_clip are unused (the common signature). Stats: clipped_high marks the tokens whose weight
    is capped (ρ > ε_max, either sign of A; they still have a gradient); clipped_low is all False.
    """
    assert logp.shape == old_logp.shape and adv.shape == logp.shape[:1], (logp.shape, old_logp.shape, adv.shape)
    ratio = importance_ratio(logp, old_logp)
    weight = ratio.clamp(max=cispo_ratio_max).detach()
    loss = -weight * adv.unsqueeze(-1) * logp
    return loss, _stats(ratio, torch.zeros_like(ratio, dtype=torch.bool), ratio.detach() > cispo_ratio_max)


def sapo(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    *,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO, soft adaptive policy optimization (arXiv 2511.20347), as TRL's GRPOTrainer defines
    loss_type="sapo": -(4/τ) · σ(τ(ρ - 1)) · A per token, τ = sapo_temperature_pos where A > 0,
    else sapo_temperature_neg (TRL's names and defaults, 1.0 and 1.05).

    A smooth gate instead of a hard clip: the gradient -4σ(1-σ)·ρ·A·∇log π equals the policy
    gradient -A·∇log π at ρ = 1 and fades as ρ leaves 1, faster for a larger τ (so a larger τ_neg
    damps negative updates more). Shapes as `clipped_surrogate`; eps_low, eps_high and dual_clip
    are unused (the common signature); nothing is clipped, so clipped_low/high are all False.
    """
    assert logp.shape == old_logp.shape and adv.shape == logp.shape[:1], (logp.shape, old_logp.shape, adv.shape)
    ratio = importance_ratio(logp, old_logp)
    a = adv.unsqueeze(-1)
    tau = torch.where(a > 0, sapo_temperature_pos, sapo_temperature_neg).to(ratio.dtype)
    loss = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * a
    none = torch.zeros_like(ratio, dtype=torch.bool)
    return loss, _stats(ratio, none, none)


# The config's loss.policy_loss is a key of this table (or "sft": offline data, no policy loss).
# Signature: (logp, old_logp, adv, loss_mask, eps_low, eps_high, dual_clip, *, own options) ->
# (per-token loss, stats). A loss's own options are keyword-only parameters named like the loss.*
# config fields that set them (cispo_ratio_max, sapo_temperature_pos/neg); the objective binds them.
POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]] = {
    "clipped": clipped_surrogate,
    "gspo": sequence_clipped_surrogate,
    "weighted_nll": weighted_nll,
    "cispo": cispo,
    "sapo": sapo,
}


RATIO_FREE = frozenset({"weighted_nll"})
"""Policy losses without an importance ratio π_θ/π_old: on-policy only at a rollout's first optimizer
step; later ones learn off-policy without correction (config.Config.off_policy_steps)."""

SEQUENCE_LEVEL = frozenset({"gspo"})
"""Policy losses whose ratio is one per sequence: they take one advantage per sequence, not the
per-token advantages of loss.advantage=gae (every other loss is elementwise in ratio and advantage)."""


def _lookup(table: dict, name: str, field: str):
    """table[name], or ValueError naming the field and the known names."""
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"{field} must be one of {tuple(table)}, got {name!r}") from None


# ----------------------------------------------------------------------------- aggregation
def _count_tokens(mask: torch.Tensor, constant_len: int | None) -> torch.Tensor:
    return mask.sum()


def _count_sequences(mask: torch.Tensor, constant_len: int | None) -> torch.Tensor:
    return mask.any(-1).sum()


def _count_rows(mask: torch.Tensor, constant_len: int | None) -> torch.Tensor:
    return torch.tensor(mask.shape[0])


def _count_none(mask: torch.Tensor, constant_len: int | None) -> torch.Tensor:
    """No divisor: 0 on every rank, which `aggregate`'s clamp(min=1) makes a divisor of 1."""
    return torch.tensor(0)


def _count_constant(mask: torch.Tensor, constant_len: int | None) -> torch.Tensor:
    if constant_len is None or constant_len <= 0:
        raise ValueError("loss_agg 'constant' needs a positive constant_len (e.g. max new tokens)")
    return torch.tensor(mask.shape[0] * constant_len)


def _sum_tokens(per_token: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return (per_token * m).sum()


def _sum_sequence_means(per_token: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    per_seq = (per_token * m).sum(-1) / m.sum(-1).clamp(min=1)
    return per_seq.sum()


@dataclass(frozen=True)
class Aggregation:
    """One way of turning per-token losses into a minibatch loss: a numerator summed per microbatch
    (`total`) over a divisor counted once on the whole minibatch (`count`).

    count(mask [N, L] bool, constant_len) -> scalar; total(per_token [n, L], mask [n, L] in
    per_token's dtype) -> scalar. `doc` is the one-line description the config reference prints.
    """

    count: Callable[[torch.Tensor, int | None], torch.Tensor]
    total: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    doc: str
    micro_count: Callable[[torch.Tensor, int | None], torch.Tensor] | None = None
    """None for every mode but bnpo: the divisor is `count` of the whole minibatch, so the update
    does not depend on the microbatch or world size (the exactness rule of the design). Set (bnpo):
    each microbatch ALSO divides by its own micro_count, and `count` counts the minibatch's rows,
    so a microbatch of n rows weighs n / rows: the update then depends on how the minibatch is cut
    into microbatches and ranks. Deliberately NOT invariant; `per_microbatch` says which kind."""

    @property
    def per_microbatch(self) -> bool:
        """True when the loss depends on the microbatch split (bnpo); tests of exactness skip these."""
        return self.micro_count is not None

    def normalizer(self, loss_mask: torch.Tensor, constant_len: int | None = None) -> torch.Tensor:
        """The divisor of `aggregate` for one whole minibatch (sum it across data-parallel ranks).

        loss_mask: [N, L] bool of the WHOLE minibatch (all microbatches of this rank).
        Returns: scalar float32 tensor.
        """
        return self.count(loss_mask.bool(), constant_len).to(torch.float32)

    def aggregate(self, per_token: torch.Tensor, loss_mask: torch.Tensor, normalizer: torch.Tensor,
                  rows: int | None = None) -> torch.Tensor:
        """Sums a microbatch's per-token loss and divides by the minibatch normalizer.

        per_token: [n, L]; loss_mask: [n, L] bool; normalizer from `normalizer` on the whole
        minibatch. Summing the results over the minibatch's microbatches gives the minibatch loss.
        rows: the microbatch's rows as the minibatch was cut (default n; a caller that forwards only
        some rows passes the full count); read by per-microbatch modes only. Returns: scalar.
        """
        total = self.total(per_token, loss_mask.to(per_token.dtype))
        if self.micro_count is None:
            return total / normalizer.clamp(min=1)
        local = self.micro_count(loss_mask.bool(), None).clamp(min=1)
        share = (loss_mask.shape[0] if rows is None else rows) / normalizer.clamp(min=1)
        return total / local * share


# The config's loss.loss_agg is a key of this table.
AGGREGATIONS: dict[str, Aggregation] = {
    "token-mean": Aggregation(_count_tokens, _sum_tokens,
                              "sum over all counted tokens / number of counted tokens (DAPO)"),
    "seq-mean-token-mean": Aggregation(_count_sequences, _sum_sequence_means,
                                       "mean over each sequence's tokens, then mean over sequences (GRPO)"),
    "seq-mean-token-sum": Aggregation(_count_sequences, _sum_tokens,
                                      "sum over each sequence's tokens, then mean over sequences"),
    "constant": Aggregation(_count_constant, _sum_tokens,
                            "sum over all counted tokens / (sequences × a fixed token budget) (Dr. GRPO)"),
    # verl core_algos.agg_loss "token-sum": the minibatch's token losses summed, no divisor.
    "token-sum": Aggregation(_count_none, _sum_tokens,
                             "sum over all counted tokens of the minibatch, not divided (verl token-sum)"),
    # TRL loss_type="bnpo": (per_token_loss * mask).sum() / mask.sum() on each microbatch, divided by
    # the gradient-accumulation steps: the mean of the microbatches' token means.
    "bnpo": Aggregation(_count_rows, _sum_tokens,
                        "each microbatch's token mean, averaged over microbatches (TRL bnpo); NOT invariant: "
                        "depends on train.microbatch_size and the world size",
                        micro_count=_count_tokens),
}


def agg_normalizer(loss_mask: torch.Tensor, mode: str, constant_len: int | None = None) -> torch.Tensor:
    """AGGREGATIONS[mode].normalizer: the divisor of `aggregate` for one whole minibatch.

    loss_mask: [N, L] bool of the WHOLE minibatch (all microbatches of this rank).
    token-mean: number of counted tokens; seq-mean-*: number of sequences with ≥ 1 counted token;
    constant (Dr. GRPO): N · constant_len, a fixed budget independent of the sampled lengths;
    token-sum: 0 (no divisor); bnpo: N rows (each microbatch also divides by its own token count).
    Returns: scalar float32 tensor.
    """
    return _lookup(AGGREGATIONS, mode, "loss_agg").normalizer(loss_mask, constant_len)


def aggregate(per_token: torch.Tensor, loss_mask: torch.Tensor, mode: str, normalizer: torch.Tensor,
              rows: int | None = None) -> torch.Tensor:
    """AGGREGATIONS[mode].aggregate: a microbatch's per-token loss summed, over the minibatch normalizer.

    per_token: [n, L]; loss_mask: [n, L] bool; normalizer from `agg_normalizer` on the whole
    minibatch. Summing the results over the minibatch's microbatches gives the minibatch loss.
    rows: see `Aggregation.aggregate` (bnpo only). Returns: scalar.
    """
    return _lookup(AGGREGATIONS, mode, "loss_agg").aggregate(per_token, loss_mask, normalizer, rows)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over True entries of mask (0 if none). Detached statistic helper. Returns scalar."""
    m = mask.to(torch.float32)
    return (x.detach().float() * m).sum() / m.sum().clamp(min=1)


def sft_nll(logp: torch.Tensor, loss_mask: torch.Tensor, normalizer: torch.Tensor | None = None) -> torch.Tensor:
    """SFT token cross-entropy as the SFT-to-GRPO spectrum writes it: mean over each response's tokens, then mean
    over responses. logp: [n, L] log-probs of the target tokens; loss_mask: [n, L].
    normalizer: number of responses in the whole (mini)batch (default: this batch's). Returns scalar.
    """
    agg = AGGREGATIONS["seq-mean-token-mean"]
    if normalizer is None:
        normalizer = agg.normalizer(loss_mask)
    return agg.aggregate(-logp, loss_mask, normalizer)


def pairwise_logsigmoid(chosen: torch.Tensor, rejected: torch.Tensor, margin: float = 0.0) -> torch.Tensor:
    """Bradley-Terry reward-model loss per pair: -log σ(s_chosen - s_rejected - margin).

    chosen, rejected: [B] scalar scores. Returns: [B] (sum and divide by the batch's pair count).
    """
    assert chosen.shape == rejected.shape and chosen.dim() == 1, (chosen.shape, rejected.shape)
    return -F.logsigmoid(chosen - rejected - margin)


def divergence_pairwise_logsigmoid(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    chosen_ids: torch.Tensor,
    rejected_ids: torch.Tensor,
    chosen_mask: torch.Tensor,
    rejected_mask: torch.Tensor,
) -> torch.Tensor:
    """Bradley-Terry loss at the first token where chosen and rejected part: a dense RM signal.

    A decoder reward model gives a score at every position (the score head applied to each hidden
    state). Up to the first differing token the two sequences are the same text, so their scores
    are equal; at that token the chosen continuation should already score higher. Per pair:
    -log σ(s_chosen[t] - s_rejected[t]) with t the first position where the ids differ and both
    rows are real tokens; 0 for pairs with no such position (identical rows, or one row a strict
    prefix of the other that ends there without EOS).

    *_scores: [B, T] float; *_ids: [B, T] int (right-padded to one width); *_mask: [B, T] bool or
    int, True/1 = real token. Returns [B] (sum and divide by the batch's pair count).
    """
    assert chosen_scores.shape == rejected_scores.shape == chosen_ids.shape == rejected_ids.shape, (
        chosen_scores.shape, rejected_scores.shape, chosen_ids.shape, rejected_ids.shape)
    both = chosen_mask.bool() & rejected_mask.bool()
    differs = (chosen_ids != rejected_ids) & both
    first_diff = differs.int().argmax(dim=1, keepdim=True)  # [B, 1]; 0 where none differs
    # the prefix before first_diff must be real in both rows (else one row ended: no comparison)
    valid = differs.any(dim=1) & (both.int().cumsum(dim=1).gather(1, first_diff).squeeze(1) == first_diff.squeeze(1) + 1)
    diff = chosen_scores.gather(1, first_diff).squeeze(1) - rejected_scores.gather(1, first_diff).squeeze(1)
    return torch.where(valid, -F.logsigmoid(diff), torch.zeros_like(diff))


def truncated_is_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling for a sampler whose numerics differ from the trainer's (Yao et
    al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"; verl's
    rollout_is_threshold): min(π_old / π_sampler, cap) per token, detached. [N, L] -> [N, L]."""
    return importance_ratio(old_logp, sampler_logp).clamp(max=cap).detach()


def logprob_mismatch(train_logp: torch.Tensor, sampler_logp: torch.Tensor,
                     loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ, max) over counted tokens of |log π_train − log π_sampler| (the train/inference mismatch);
    0-dim tensors, max 0 without counted tokens. [N, L] each."""
    gap = (train_logp.detach().float() - sampler_logp.float()).abs() * loss_mask
    return gap.sum(), gap.max() if gap.numel() else gap.new_zeros(())
