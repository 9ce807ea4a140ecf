"""The per-microbatch GRPO-family loss, assembled once at setup from the config.

The variant (token clip, GSPO, weighted NLL, CISPO, SAPO; KL estimator; aggregation) is picked
here from the registries of `grpolab.algo`, never by string comparisons inside the training loop.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from grpolab.algo.losses import (AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES, Aggregation, importance_ratio,
                                 logprob_mismatch, truncated_is_weights)
from grpolab.forward import LogProbForward
from grpolab.batch import Rollout


@dataclass(frozen=True)
class Objective:
    policy_loss: Callable
    """An entry of `algo.losses.POLICY_LOSSES`, its own options (keyword-only) already bound."""
    eps_low: float
    eps_high: float
    dual_clip: float | None
    kl_coef: float
    """β of the KL loss term; 0 = none (also with loss.kl_in_reward, where β applies to the rewards)."""
    kl_estimator: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(logp, ref_logp) -> per-token KL estimate (`algo.losses.KL_ESTIMATORS`)."""
    kl_ratio_weighted: bool
    entropy_coef: float
    aggregation: Aggregation
    """Per-token losses -> the microbatch's share of the minibatch loss (`algo.losses.AGGREGATIONS`)."""
    agg_constant_tokens: int
    forward: LogProbForward
    """The log-prob forward of the run (layout, dtype, temperature)."""
    measure_kl: bool = False
    """A reference model is loaded: the KL to it is computed and reported, a loss term when kl_coef > 0."""
    tis_cap: float = 0.0
    """loss.tis_cap: the policy loss of each token weighted by min(π_old / π_sampler, tis_cap) (0 = off)."""

    def normalizer(self, loss_mask: torch.Tensor) -> torch.Tensor:
        """The minibatch-wide divisor of the aggregation, counted on the whole minibatch's mask."""
        return self.aggregation.normalizer(loss_mask, self.agg_constant_tokens)

    def __call__(self, model, micro: Rollout, normalizer: torch.Tensor,
                 rows: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss of one microbatch (already divided by the minibatch normalizer) and detached stats.

        Stats: token sums of kl, ratio, clipped_low/high, entropy; 'tokens'; ratio_min/ratio_max;
        'logp' [b, Lc'] the detached token log-probs. With old_logp = None (first epoch, one
        minibatch), old = new.detach() and the ratio ≡ 1 exactly. rows: the microbatch's row count
        as Phase B cut it, when only some of its rows are passed (`SkipEmptyRows`); read only by a
        per-microbatch aggregation (bnpo).
        """
        logp, ent = self.forward(model, micro, with_entropy=True, entropy_grad=self.entropy_coef > 0)
        old = micro.old_logp if micro.old_logp is not None else logp.detach()
        mask = micro.loss_mask
        per_tok, st = self.policy_loss(logp, old, micro.advantages, mask, self.eps_low, self.eps_high, self.dual_clip)
        sampler = micro.sampler_logp
        if self.tis_cap > 0 and sampler is not None:  # the sampler's numerics are not the trainer's
            per_tok = per_tok * truncated_is_weights(old, sampler, self.tis_cap)
        gap_sum, gap_max = logprob_mismatch(old, sampler, mask) if sampler is not None else (logp.new_zeros(()),) * 2
        kl = torch.zeros_like(logp)
        if self.measure_kl:
            kl = self.kl_estimator(logp, micro.ref_logp)
            if self.kl_ratio_weighted:
                kl = kl * importance_ratio(logp, old)
            if self.kl_coef > 0:
                per_tok = per_tok + self.kl_coef * kl
        if self.entropy_coef > 0:
            per_tok = per_tok - self.entropy_coef * ent
            ent = ent.detach()
        loss = self.aggregation.aggregate(per_tok, mask, normalizer, rows)
        m = mask.float()
        ratio = st["ratio"].float()
        stats = {
            "kl": (kl.detach() * m).sum(),
            "ratio": (ratio * m).sum(),
            "clipped_low": (st["clipped_low"].float() * m).sum(),
            "clipped_high": (st["clipped_high"].float() * m).sum(),
            "entropy": (ent.detach() * m).sum(),
            "tokens": m.sum(),
            "ratio_min": torch.where(mask, ratio, torch.full_like(ratio, float("inf"))).min(),
            "ratio_max": torch.where(mask, ratio, torch.full_like(ratio, float("-inf"))).max(),
            "mismatch": gap_sum,
            "mismatch_max": gap_max,
            "loss": loss.detach(),
            "logp": logp.detach(),
        }
        return loss, stats


def bind_options(policy_loss: Callable, loss_cfg) -> Callable:
    """`policy_loss` with its own options bound: each keyword-only parameter gets the loss.* config
    field of the same name (CISPO's cispo_ratio_max, SAPO's sapo_temperature_pos/neg). A loss whose
    option has no config field fails here, at setup (AttributeError naming it)."""
    names = [p.name for p in inspect.signature(policy_loss).parameters.values() if p.kind is p.KEYWORD_ONLY]
    return functools.partial(policy_loss, **{name: getattr(loss_cfg, name) for name in names})


def per_token_advantages(policy_loss: Callable) -> Callable:
    """`policy_loss` taking per-token advantages adv [N, L] (loss.advantage=gae) instead of [N]: each
    token is passed as a sequence of its own ([N·L, 1] log-probs, [N·L] advantages), which gives
    exactly the loss a token-level policy loss (clipped, weighted_nll, cispo, sapo: elementwise in
    ratio and advantage) would give with adv[:, t] at token t. Not for a sequence-level ratio
    (algo.losses.SEQUENCE_LEVEL; config validation refuses it)."""
    def loss(logp, old_logp, adv, loss_mask, *args):
        n, width = logp.shape
        assert adv.shape == logp.shape, (adv.shape, logp.shape)
        per_tok, st = policy_loss(logp.reshape(-1, 1), old_logp.reshape(-1, 1), adv.reshape(-1),
                                  loss_mask.reshape(-1, 1), *args)
        return per_tok.view(n, width), {k: v.view(n, width) for k, v in st.items()}
    return loss


def build_objective(loss_cfg, rollout_cfg, forward: LogProbForward, token_advantages: bool = False) -> Objective:
    """Selects the policy loss from the registry once; returns the callable objective.
    token_advantages: the advantages are per token ([N, L], `per_token_advantages`)."""
    if loss_cfg.policy_loss not in POLICY_LOSSES:
        raise ValueError(f"loss.policy_loss={loss_cfg.policy_loss!r} is not a GRPO-family loss; "
                         f"choose one of {sorted(POLICY_LOSSES)} (use `grpolab sft` for 'sft')")
    policy_loss = bind_options(POLICY_LOSSES[loss_cfg.policy_loss], loss_cfg)
    return Objective(
        policy_loss=per_token_advantages(policy_loss) if token_advantages else policy_loss,
        eps_low=loss_cfg.clip_eps_low,
        eps_high=loss_cfg.clip_eps_high,
        dual_clip=loss_cfg.dual_clip,
        kl_coef=0.0 if loss_cfg.kl_in_reward else loss_cfg.kl_coef,
        measure_kl=loss_cfg.kl_coef > 0,
        tis_cap=loss_cfg.tis_cap,
        kl_estimator=KL_ESTIMATORS[loss_cfg.kl_estimator],
        kl_ratio_weighted=loss_cfg.kl_ratio_weighted,
        entropy_coef=loss_cfg.entropy_coef,
        aggregation=AGGREGATIONS[loss_cfg.loss_agg],
        agg_constant_tokens=loss_cfg.agg_constant_tokens or rollout_cfg.max_new_tokens,
        forward=forward,
    )


class SkipEmptyRows:
    """Wraps an Objective so a microbatch's forward/backward runs only on rows with counted tokens
    (whole groups with a shared-prompt layout: a group is kept when any of its rows counts).

    Rows whose loss mask is all False (groups dropped by loss.filter_zero_std_groups, completions
    masked by loss.mask_truncated) add exactly 0 to the loss and the gradient, and the minibatch
    normalizer was counted before, on the whole minibatch: skipping them changes nothing but the
    time (bnpo, whose microbatch weighs its rows, is told the full count and its token count is
    the same). The returned `logp` stat covers every row (0 on the skipped ones, which never count).
    """

    def __init__(self, objective: Objective, whole_groups: bool = False):
        self.objective, self.whole_groups = objective, whole_groups

    def normalizer(self, loss_mask: torch.Tensor) -> torch.Tensor:
        return self.objective.normalizer(loss_mask)

    def __call__(self, model, micro: Rollout, normalizer: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        counts = micro.loss_mask.any(-1)
        if self.whole_groups:
            counts = counts.view(-1, micro.group_size).any(-1).repeat_interleave(micro.group_size)
        keep = counts.nonzero().squeeze(-1)
        if keep.numel() == micro.num_sequences:
            return self.objective(model, micro, normalizer)
        if keep.numel() == 0:  # keep one row (or group) so the loss, exactly 0, still has a graph
            keep = torch.arange(micro.group_size if self.whole_groups else 1, device=counts.device)
        n, width = micro.num_sequences, micro.loss_mask.shape[1]
        loss, stats = self.objective(model, micro.select(keep), normalizer, rows=n)  # bnpo weighs all n rows
        logp = torch.nn.functional.pad(stats["logp"], (0, width - stats["logp"].shape[1]))
        stats["logp"] = logp.new_zeros((n, width)).index_copy(0, keep.to(logp.device), logp)
        return loss, stats


def build_loss(loss_cfg, rollout_cfg, forward: LogProbForward, critic=None):
    """The run's objective: `build_objective`; with a critic (loss.advantage=gae) on per-token
    advantages plus its value loss (`grpo.critic.ValueLoss`); wrapped in `SkipEmptyRows` when the
    config can leave rows without counted tokens (loss.filter_zero_std_groups, loss.mask_truncated)."""
    objective = build_objective(loss_cfg, rollout_cfg, forward, token_advantages=critic is not None)
    if critic is not None:
        objective = critic.with_value_loss(objective)
    if loss_cfg.filter_zero_std_groups or loss_cfg.mask_truncated:
        return SkipEmptyRows(objective, forward.layout.whole_groups)
    return objective
