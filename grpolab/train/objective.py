"""The per-microbatch GRPO-family loss, assembled once at setup from the config.

The variant (token clip, GSPO, weighted NLL; KL estimator; aggregation) is picked here from the
registries of `grpolab.algo`, never by string comparisons inside the training loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from grpolab.algo.losses import POLICY_LOSSES, importance_ratio, aggregate, agg_normalizer, kl_penalty
from grpolab.models.forward import completion_logprobs
from grpolab.rollout.types import Rollout


@dataclass(frozen=True)
class Objective:
    policy_loss: Callable
    eps_low: float
    eps_high: float
    dual_clip: float | None
    kl_coef: float
    kl_estimator: str
    kl_ratio_weighted: bool
    entropy_coef: float
    agg_mode: str
    agg_constant_tokens: int
    temperature: float
    compute_dtype: torch.dtype | None = None
    padding_free: bool = False
    shared_prompt: bool = False
    """Microbatches are whole groups whose prompt is forwarded once (model.shared_prompt)."""

    def normalizer(self, loss_mask: torch.Tensor) -> torch.Tensor:
        """The minibatch-wide divisor (see algo.losses.agg_normalizer)."""
        return agg_normalizer(loss_mask, self.agg_mode, self.agg_constant_tokens)

    def __call__(self, model, micro: Rollout, normalizer: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss of one microbatch (already divided by the minibatch normalizer) and detached stats.

        Stats: token sums of kl, ratio, clipped_low/high, entropy; 'tokens'; ratio_min/ratio_max;
        'logp' [b, Lc'] the detached token log-probs. With old_logp = None (first epoch, one
        minibatch), old = new.detach() and the ratio ≡ 1 exactly.
        """
        logp, ent = completion_logprobs(
            model, micro.input_ids, micro.attention_mask, micro.prompt_len, self.temperature,
            with_entropy=True, compute_dtype=self.compute_dtype, entropy_grad=self.entropy_coef > 0,
            padding_free=self.padding_free, group_size=micro.group_size if self.shared_prompt else None,
        )
        old = micro.old_logp if micro.old_logp is not None else logp.detach()
        mask = micro.loss_mask
        per_tok, st = self.policy_loss(logp, old, micro.advantages, mask, self.eps_low, self.eps_high, self.dual_clip)
        kl = torch.zeros_like(logp)
        if self.kl_coef > 0:
            kl = kl_penalty(logp, micro.ref_logp, self.kl_estimator)
            if self.kl_ratio_weighted:
                kl = kl * importance_ratio(logp, old)
            per_tok = per_tok + self.kl_coef * kl
        if self.entropy_coef > 0:
            per_tok = per_tok - self.entropy_coef * ent
            ent = ent.detach()
        loss = aggregate(per_tok, mask, self.agg_mode, normalizer)
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
            "loss": loss.detach(),
            "logp": logp.detach(),
        }
        return loss, stats


def build_objective(loss_cfg, rollout_cfg, compute_dtype=None, padding_free: bool = False,
                    shared_prompt: bool = False) -> Objective:
    """Selects the policy loss from the registry once; returns the callable objective."""
    if loss_cfg.policy_loss not in POLICY_LOSSES:
        raise ValueError(f"loss.policy_loss={loss_cfg.policy_loss!r} is not a GRPO-family loss; "
                         f"choose one of {sorted(POLICY_LOSSES)} (use `grpolab sft` for 'sft')")
    return Objective(
        policy_loss=POLICY_LOSSES[loss_cfg.policy_loss],
        eps_low=loss_cfg.clip_eps_low,
        eps_high=loss_cfg.clip_eps_high,
        dual_clip=loss_cfg.dual_clip,
        kl_coef=loss_cfg.kl_coef,
        kl_estimator=loss_cfg.kl_estimator,
        kl_ratio_weighted=loss_cfg.kl_ratio_weighted,
        entropy_coef=loss_cfg.entropy_coef,
        agg_mode=loss_cfg.loss_agg,
        agg_constant_tokens=loss_cfg.agg_constant_tokens or rollout_cfg.max_new_tokens,
        temperature=rollout_cfg.temperature,
        compute_dtype=compute_dtype,
        padding_free=padding_free,
        shared_prompt=shared_prompt,
    )
