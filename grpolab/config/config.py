"""The Config root: the sections together, the derived sizes, validation; from a preset, a YAML file.

Every size carries its unit in its name; `minibatch_size` and `microbatch_size` count sequences
(completions), never prompts. Derived sizes are properties. Nothing here is mutated after
construction: overrides build a new Config. `validate()` rejects impossible settings at start-up
with a message naming the field and the fix (grpolab/config/validation.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from grpolab.config.data import DataConfig
from grpolab.config.environment import EnvironmentConfig
from grpolab.config.evaluation import EvalConfig
from grpolab.config.io import apply_overrides, dump_yaml, load_yaml, override_strings
from grpolab.config.loss import LossConfig
from grpolab.config.model import ModelConfig
from grpolab.config.presets import PRESETS
from grpolab.config.rewards import RewardSpec
from grpolab.config.rm_refresh import RMRefreshConfig
from grpolab.config.rollout import RolloutConfig
from grpolab.config.run import RunConfig
from grpolab.config.sft import SFTConfig
from grpolab.config.train import TrainConfig
from grpolab.config.validation import validate_config
from grpolab.errors import ConfigError


@dataclass(frozen=True)
class Config:
    """A whole run: one section per dataclass, plus the preset's name and the reward functions."""

    preset: str = "grpo"
    """Name of the preset these values started from (informational)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rewards: tuple[RewardSpec, ...] = (RewardSpec("exact_match", 1.0), RewardSpec("refusal", 1.0))
    """Reward functions and their weights; the combined reward is their weighted sum."""
    rm_refresh: RMRefreshConfig = field(default_factory=RMRefreshConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    """Multi-turn episodes: the environment (empty name: none)."""
    run: RunConfig = field(default_factory=RunConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    # ---- derived sizes (never stored) ----
    @property
    def sequences_per_step(self) -> int:
        """N = prompts_per_step × group_size."""
        return self.rollout.prompts_per_step * self.rollout.group_size

    @property
    def minibatches_per_epoch(self) -> int:
        return self.sequences_per_step // self.minibatch_sequences

    @property
    def minibatch_sequences(self) -> int:
        """Sequences per optimizer step: train.minibatch_size, or the whole step's N when it is 0."""
        return self.train.minibatch_size or self.sequences_per_step

    @property
    def off_policy_steps(self) -> int:
        """Optimizer steps per rollout that learn off-policy WITHOUT correction: all but the first
        when loss.policy_loss has no importance ratio (algo.losses.RATIO_FREE) and a rollout gets
        several optimizer steps (epochs × minibatches); 0 otherwise."""
        from grpolab.algo.losses import RATIO_FREE

        return self.optimizer_steps_per_step - 1 if self.loss.policy_loss in RATIO_FREE else 0

    @property
    def world_size(self) -> int:
        """Data-parallel ranks, as the launcher set them (torchrun's WORLD_SIZE; 1 without one)."""
        from grpolab.parallel.launch import launch_world_size

        return launch_world_size()

    @property
    def microbatches_per_minibatch(self) -> int:
        """Per rank."""
        return self.minibatch_sequences // (self.train.microbatch_size * self.world_size)

    @property
    def optimizer_steps_per_step(self) -> int:
        return self.train.epochs * self.minibatches_per_epoch

    @property
    def episodes(self) -> bool:
        """Phase A samples multi-turn episodes (an environment or tools are set), not single completions."""
        return bool(self.environment.name or self.rollout.tools)

    @property
    def needs_reference(self) -> bool:
        return self.loss.kl_coef > 0

    @property
    def needs_old_logp_pass(self) -> bool:
        """Phase A forwards π_old over the rollout: with several minibatches per epoch, or when
        loss.kl_in_reward needs log π_old before the advantages. Else epoch 0's forward of every row
        runs under π_old (before its only optimizer step) and Phase B records old_logp there."""
        return self.minibatches_per_epoch > 1 or self.loss.kl_in_reward

    def validate(self) -> "Config":
        """Raises ConfigError naming the field and the fix; returns self for chaining."""
        validate_config(self)
        return self

    def replace(self, **dotted: Any) -> "Config":
        """A new Config with dotted overrides, e.g. replace(**{"loss.kl_coef": 0.0})."""
        return apply_overrides(self, override_strings(dotted))


# Each preset is only a set of field values on top of the defaults (which are GRPO's).


def from_preset(name: str, overrides: list[str] | None = None) -> Config:
    """Config of a preset with dotted `key=value` overrides applied, validated."""
    if name not in PRESETS:
        raise ConfigError(f"preset: unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    cfg = apply_overrides(Config(preset=name), override_strings(PRESETS[name]))
    return apply_overrides(cfg, overrides or []).validate()


def load(path: str, overrides: list[str] | None = None) -> Config:
    """Config from a YAML file (a `preset:` key picks the starting values), then overrides."""
    return load_yaml(path, overrides or [], Config, PRESETS).validate()


def dump(cfg: Config, path: str | None = None) -> str:
    """The fully resolved config as YAML (written to path if given)."""
    text = dump_yaml(cfg)
    if path:
        with open(path, "w") as f:
            f.write(text)
    return text
