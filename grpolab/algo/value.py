"""PPO's value function: token rewards, GAE, whitening, the clipped value loss. Pure torch.

Shapes: N completions, L completion positions; `mask` [N, L] bool, True = this token counts (a
prefix of each row: through the first EOS). Position t is the state before completion token t is
sampled (the prompt and tokens < t), so V[:, t] is read at the hidden state that predicts token t.

The definitions are verl's (`verl/trainer/ppo/core_algos.py`: compute_gae_advantage_return,
compute_value_loss; both adapted from TRL's PPOTrainer): an outcome reward sits on the last
counted token, GAE runs backwards over the counted tokens, returns = advantages + values, the
advantages are whitened over the batch, and the value loss is 0.5 · max((V - R)², (clip(V,
V_old ± ε_v) - R)²). Statistics come back as detached tensors; nothing here calls `.item()`.
"""

from __future__ import annotations

import torch


def _check(x: torch.Tensor, mask: torch.Tensor, name: str) -> None:
    assert x.dim() == 2 and x.shape == mask.shape, f"{name} must be [N, L] like mask {tuple(mask.shape)}, got {tuple(x.shape)}"


def last_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each completion's outcome reward placed on its last counted token, 0 elsewhere.

    rewards: [N] float (finite); mask: [N, L] bool. Returns [N, L] in rewards' dtype; a row without
    a counted token gets no reward.
    """
    assert rewards.shape == mask.shape[:1], (rewards.shape, mask.shape)
    m = mask.long()
    last = (m * torch.arange(1, mask.shape[1] + 1, device=mask.device)).argmax(-1)  # the last True
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    out[torch.arange(mask.shape[0], device=mask.device), last] = rewards
    return torch.where(mask, out, torch.zeros_like(out))


def token_rewards(outcome: torch.Tensor, mask: torch.Tensor, kl_penalty: torch.Tensor | None = None) -> torch.Tensor:
    """The per-token rewards of PPO: the outcome reward on the last counted token, minus the KL
    penalty β·kl_t on every counted token (TRL's PPOTrainer: -kl_coef · kl, plus the score at the
    end; verl's apply_kl_penalty). outcome: [N]; mask: [N, L] bool; kl_penalty: [N, L] the per-token
    penalty of `algo.kl.kl_reward_penalty`, or None. Returns [N, L], 0 outside the mask."""
    r = last_token_rewards(outcome, mask)
    if kl_penalty is None:
        return r
    _check(kl_penalty, mask, "kl_penalty")
    return r - torch.where(mask, kl_penalty, torch.zeros_like(kl_penalty)).to(r.dtype)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) as verl's compute_gae_advantage_return,
    before its whitening.

    rewards (per token, `token_rewards`), values: [N, L] float; mask: [N, L] bool. Backwards over the positions:
    δ_t = r_t + γ·V_next - V_t and A_t = δ_t + γλ·A_next, where V_next and A_next are those of the
    next COUNTED position (0 past the last): positions outside the mask are skipped, as verl does.
    With γ = λ = 1, A_t = Σ_{t' ≥ t} r_t' - V_t (the Monte-Carlo return minus the value).
    Returns (advantages, returns = advantages + values), each [N, L]; 0 outside the mask.
    """
    _check(rewards, mask, "rewards")
    _check(values, mask, "values")
    m = mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    out = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        next_value = torch.where(mask[:, t], values[:, t], next_value)
        next_adv = torch.where(mask[:, t], adv, next_adv)
        out[:, t] = adv * m[:, t]
    return out, (out + values) * m


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the counted entries, as verl's and TRL's masked_whiten
    (shift_mean=True; var with Bessel's correction n / (n - 1)). x: [N, L]; mask: [N, L] bool.
    Returns [N, L], 0 outside the mask (and everywhere when the counted entries are all equal)."""
    _check(x, mask, "x")
    m = mask.to(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / n.clamp(min=1)
    var = (((x - mean) * m) ** 2).sum() / (n - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * m


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               clip: float | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss per token, as verl's compute_value_loss before its aggregation:
    0.5 · max((V - R)², (clip(V, V_old - ε_v, V_old + ε_v) - R)²); clip None: 0.5 · (V - R)².

    values: [N, L] V under the current parameters (with grad); old_values: [N, L] V_old recorded in
    Phase A; returns: [N, L] the targets R. Aggregate the result like the policy loss (its mask).
    Returns (per-token loss [N, L], stats {'clipped': [N, L] bool, True where the clipped term is
    the larger one, so V gets no gradient: verl's vf_clipfrac}).
    """
    assert values.shape == old_values.shape == returns.shape, (values.shape, old_values.shape, returns.shape)
    plain = (values - returns) ** 2
    if clip is None:
        return 0.5 * plain, {"clipped": torch.zeros_like(plain, dtype=torch.bool)}
    clipped_v = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (clipped_v - returns) ** 2
    return 0.5 * torch.maximum(plain, clipped), {"clipped": (clipped > plain).detach()}


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) over the counted tokens (verl's critic/vf_explained_var): 1 = V
    predicts R exactly, 0 = no better than a constant, < 0 worse. values, returns: [N, L]; mask:
    [N, L] bool. Returns a detached scalar; NaN when R does not vary."""
    _check(values, mask, "values")
    m = mask.to(torch.float32)
    n = m.sum().clamp(min=1)

    def var(x):
        x = x.detach().float()
        mean = (x * m).sum() / n
        return (((x - mean) * m) ** 2).sum() / n

    v_r = var(returns)
    return torch.where(v_r > 0, 1 - var(returns - values) / v_r, torch.full_like(v_r, float("nan")))
