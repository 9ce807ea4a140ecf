"""The presets of the SFT-to-GRPO spectrum: each only a set of field values on top of the defaults."""

from __future__ import annotations

from typing import Any

_ONE_UPDATE = {"loss.policy_loss": "weighted_nll", "loss.kl_coef": 0.0, "train.minibatch_size": 0, "train.epochs": 1}
"""No importance ratio, so one optimizer step per rollout: every step on-policy."""
PRESETS: dict[str, dict[str, Any]] = {
    "sft": {"loss.policy_loss": "sft", "loss.kl_coef": 0.0},
    "onpolicy_sft": {**_ONE_UPDATE, "loss.advantage": "relu"},
    "reinforce": {**_ONE_UPDATE, "loss.advantage": "reinforce"},
    "reinforce_norm": {**_ONE_UPDATE, "loss.advantage": "group_norm"},
    "grpo": {},
    "grpo_no_kl": {"loss.kl_coef": 0.0},
    "dr_grpo": {"loss.std": "none", "loss.loss_agg": "constant", "loss.kl_coef": 0.0},
    "dapo": {"loss.clip_eps_low": 0.2, "loss.clip_eps_high": 0.28, "loss.kl_coef": 0.0, "loss.loss_agg": "token-mean",
             "loss.filter_zero_std_groups": True, "rollout.dynamic_sampling": True},
    "gspo": {"loss.policy_loss": "gspo", "loss.clip_eps_low": 3e-4, "loss.clip_eps_high": 4e-4, "loss.kl_coef": 0.0,
             "loss.loss_agg": "seq-mean-token-mean"},
    "rloo": {"loss.advantage": "rloo", "loss.kl_coef": 0.0},
    # the spectrum's futures, GRPO minus one trick each (grpo_no_kl drops the KL): sft_o1 = on-policy SFT with
    # twice the on-policy steps for the same sampled completions; grpo_no_is = no ratio (SimPO's route)
    "sft_o1": {**_ONE_UPDATE, "loss.advantage": "relu", "rollout.prompts_per_step": 8, "train.steps": 100},
    "grpo_no_is": {"loss.policy_loss": "weighted_nll", "loss.kl_coef": 0.0, "loss.loss_agg": "seq-mean-token-mean"},
    # a learned value function: PPO, its KL per token in the reward (TRL's PPOTrainer: k1, β = 0.05)
    "ppo": {"loss.advantage": "gae", "loss.loss_agg": "token-mean", "loss.kl_in_reward": True,
            "loss.kl_estimator": "k1", "loss.kl_coef": 0.05},
}
