"""PPO's value function in the GRPO loop (loss.advantage=gae), built once at setup.

    Phase A  `record_values`: V_old of every completion token under π_old (the trunk alone, no
             grad). `advantages`: the outcome reward (minus β·KL_t per token with
             loss.kl_in_reward) on the last token, GAE (γ = loss.gae_gamma, λ = loss.gae_lambda),
             returns R = A + V_old, A whitened over the batch.
    Phase B  `ValueLoss`: the policy objective on the per-token advantages, plus loss.value_coef ×
             the clipped value loss (algo/value.py), aggregated like the policy loss, from the
             same forward (the trunk's hidden states reach the head through a forward hook).

The head shares the policy's trunk, as TRL's value-head models do (verl and OpenRLHF train a
separate critic model): no second model or forward, and the value loss shapes the trunk too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import torch

from grpolab.algo.value import explained_variance, gae, masked_whiten, token_rewards, value_loss
from grpolab.forward import LogProbForward
from grpolab.models.value_head import ValueHead, captured_hidden, completion_values, decoder_of, rollout_values
from grpolab.batch import Rollout


@dataclass
class Critic:
    """The value head, where it reads the trunk, and PPO's options: what Phase A and B call."""

    head: ValueHead
    """V = w·h + b on the trunk's last hidden state; trained by the run's optimizer, checkpointed."""
    decoder: torch.nn.Module
    """The policy's trunk (`models.value_head.decoder_of`)."""
    forward: LogProbForward
    """The run's forward: chunking and compute dtype of Phase A's value pass."""
    gamma: float
    lam: float
    value_coef: float
    value_clip: float | None
    sums: list[torch.Tensor] = field(default_factory=list)
    """Phase B's detached [value-loss sum, clipped tokens, tokens] per microbatch, until `step_metrics`."""

    @classmethod
    def from_config(cls, loss_cfg, policy: torch.nn.Module, forward: LogProbForward) -> "Critic":
        device = next(policy.parameters()).device
        head = ValueHead(policy.config.hidden_size).to(device)
        return cls(head, decoder_of(policy), forward, loss_cfg.gae_gamma, loss_cfg.gae_lambda, loss_cfg.value_coef,
                   loss_cfg.value_clip)

    def record_values(self, ro: Rollout) -> Rollout:
        """Phase A: ro with `values` [N, Lc], V_old under the current (π_old) parameters."""
        chunks = self.forward.chunks(ro, self.forward.chunk_rows)
        return ro.replace(values=rollout_values(self.head, self.decoder, ro, chunks, self.forward.compute_dtype))

    @torch.no_grad()
    def advantages(self, ro: Rollout, rewards: torch.Tensor, kl_penalty: torch.Tensor | None = None) -> Rollout:
        """Phase A: ro with token_advantages (whitened GAE), returns, advantages (each row's mean of
        its token advantages) and a loss mask without the rows whose every reward abstained.

        rewards: [N] the combined rewards (NaN = every function abstained), without a KL penalty;
        kl_penalty: [N, L] β·KL_t per token (loss.kl_in_reward, `algo.kl.kl_reward_penalty`), or None."""
        mask = ro.loss_mask & ~torch.isnan(rewards).to(ro.loss_mask.device).unsqueeze(-1)
        outcome = torch.nan_to_num(rewards, nan=0.0).to(ro.values)
        adv, returns = gae(token_rewards(outcome, mask, kl_penalty), ro.values, mask, self.gamma, self.lam)
        adv = masked_whiten(adv, mask)
        per_row = adv.sum(-1) / mask.sum(-1).clamp(min=1)
        return ro.replace(token_advantages=adv, returns=returns, advantages=per_row, loss_mask=mask)

    def with_value_loss(self, objective) -> "ValueLoss":
        return ValueLoss(objective, self)

    def step_metrics(self, ro: Rollout) -> dict[str, float]:
        """The value metrics of the step (and the Phase B sums are reset): value/loss and
        value/clip_frac per trained token, value/mean and value/explained_var of V_old against
        the returns over the counted tokens."""
        total = torch.stack(self.sums).sum(0) if self.sums else torch.zeros(3)
        self.sums.clear()
        tokens = max(float(total[2]), 1.0)
        m = ro.loss_mask
        return {
            "value/loss": float(total[0]) / tokens,
            "value/clip_frac": float(total[1]) / tokens,
            "value/mean": float((ro.values * m).sum() / m.sum().clamp(min=1)),
            "value/explained_var": float(explained_variance(ro.values, ro.returns, m)),
        }


class ValueLoss:
    """An `Objective` on the per-token advantages, plus value_coef × the clipped value loss of the
    same microbatch, aggregated with the objective's aggregation and minibatch normalizer (so the
    update stays independent of the microbatch size)."""

    def __init__(self, objective, critic: Critic):
        self.objective, self.critic = objective, critic

    def normalizer(self, loss_mask: torch.Tensor) -> torch.Tensor:
        return self.objective.normalizer(loss_mask)

    def __call__(self, model, micro: Rollout, normalizer: torch.Tensor,
                 rows: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        c = self.critic
        with captured_hidden(c.decoder) as hidden:
            loss, stats = self.objective(model, micro.replace(advantages=micro.token_advantages), normalizer, rows)
        assert len(hidden) == 1, f"the objective's forward ran the trunk {len(hidden)} times, not once"
        values = completion_values(c.head, hidden[0], micro.prompt_len)
        per_tok, vst = value_loss(values, micro.values, micro.returns, c.value_clip)
        v_loss = self.objective.aggregation.aggregate(per_tok, micro.loss_mask, normalizer, rows)
        m = micro.loss_mask.to(per_tok.dtype)
        c.sums.append(torch.stack([(per_tok.detach() * m).sum(), (vst["clipped"] * m).sum(), m.sum()]).cpu())
        return loss + c.value_coef * v_loss, stats
