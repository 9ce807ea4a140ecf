"""The `loss:` section: the policy loss, advantages, KL and the value head."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LossConfig:
    """The training objective: policy loss, advantages, KL penalty, aggregation."""

    policy_loss: str = "clipped"
    """The per-token policy objective (a key of algo.losses.POLICY_LOSSES), or sft: supervised
    fine-tuning on offline data instead of GRPO."""
    advantage: str = "group_norm"
    """How each completion's reward becomes its advantage (a key of algo.advantages.ADVANTAGE_ESTIMATORS)."""
    std: str = "sample"
    """How loss.advantage=group_norm scales the centred rewards (a key of algo.advantages.STD_MODES):
    each group's own std, none, or one std over the whole step's rewards (every rank's groups)."""
    std_eps: float = 1e-6
    """Added to the group std before dividing."""
    clip_eps_low: float = 0.2
    """Lower clip: ratio floor 1 - clip_eps_low."""
    clip_eps_high: float = 0.2
    """Upper clip: ratio ceiling 1 + clip_eps_high (DAPO clip-higher: 0.28)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens; None = off."""
    cispo_ratio_max: float = 5.0
    """loss.policy_loss=cispo: ε_max, the cap on the importance weight π/π_old (a ratio, not an offset
    from 1), which is detached, so capped tokens keep their gradient. TRL's epsilon_high under
    loss_type="cispo" (whose doc recommends 5.0, the ScaleRL value; unset, TRL would cap at epsilon)."""
    sapo_temperature_pos: float = 1.0
    """loss.policy_loss=sapo: temperature τ of the soft gate σ(τ(ρ-1)) on tokens with advantage > 0 (TRL's default)."""
    sapo_temperature_neg: float = 1.05
    """loss.policy_loss=sapo: temperature τ of the soft gate on tokens with advantage ≤ 0 (TRL's default)."""
    kl_coef: float = 0.04
    """β of the KL penalty to the frozen reference; 0 = no reference model is loaded."""
    kl_estimator: str = "k3"
    """Per-token estimator of KL(π || π_ref) for the KL penalty (a key of algo.losses.KL_ESTIMATORS)."""
    kl_ratio_weighted: bool = True
    """Multiply the per-token KL by π/π_old (unbiased when samples come from π_old; TRL's default)."""
    tis_cap: float = 0.0
    """Truncated importance sampling (verl's rollout_is_threshold; Yao et al. 2025): each token's loss is
    weighted by min(π_old / π_sampler, tis_cap), correcting for a sampler whose numerics differ from the
    trainer's (vLLM, bf16 weights). 0 = off."""
    kl_in_reward: bool = False
    """KL as a reward penalty instead of a loss term (verl's algorithm.use_kl_in_reward): each
    completion's reward becomes r - kl_coef · Σ_t KL_t(π_old ‖ π_ref), the loss.kl_estimator summed
    over its counted tokens (verl's default estimator there is k1), before the advantages; Phase A
    then records log π_old too. The loss has no KL term (the KL is still reported). Needs kl_coef > 0."""
    multi_objective_aggregation: str = "sum_then_normalize"
    """How several reward functions make one reward (TRL's option and values): sum_then_normalize =
    their weighted sum; normalize_then_sum = each function's scores normalized within the group
    first ((s - group mean) / (group sample std + loss.std_eps), GDPO), then the weighted sum. TRL
    then scales by the batch std: loss.std=batch gives its recipe."""
    loss_agg: str = "seq-mean-token-mean"
    """How per-token losses are summed and normalized into the minibatch loss (a key of
    algo.losses.AGGREGATIONS); the normalizer is counted on the whole minibatch, so the gradient
    does not depend on the microbatch size — except TRL's per-microbatch normalizer (its entry says
    so), whose gradient depends on train.microbatch_size and the world size on purpose."""
    agg_constant_tokens: int = 0
    """Tokens per sequence of the 'constant' normalizer; 0 = rollout.max_new_tokens."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (loss -= coef · entropy)."""
    mask_truncated: bool = False
    """Give no loss to completions cut at max_new_tokens."""
    filter_zero_std_groups: bool = False
    """Drop groups whose rewards are all equal from the loss, without resampling (see rollout.dynamic_sampling)."""
    gae_gamma: float = 1.0
    """loss.advantage=gae: discount γ of the token rewards (TRL's PPO gamma and verl's algorithm.gamma, both 1.0)."""
    gae_lambda: float = 0.95
    """loss.advantage=gae: GAE's λ, from 0 (one-step TD) to 1 (Monte-Carlo returns minus V); TRL's PPO lam."""
    value_coef: float = 0.1
    """loss.advantage=gae: weight of the value loss 0.5·max((V - R)², (clip(V, V_old ± value_clip) - R)²),
    aggregated like the policy loss and added to it (TRL's vf_coef)."""
    value_clip: float | None = 0.2
    """loss.advantage=gae: how far V may move from V_old before the clipped term takes over (TRL's
    cliprange_value); None = the plain 0.5·(V - R)²."""
