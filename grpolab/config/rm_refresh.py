"""The `rm_refresh:` section: iterated reward-model updates during GRPO."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RMRefreshConfig:
    """Iterated reward-model updates during GRPO (grpolab/reward_models/refresh.py): every `every_steps`
    steps, pairs of the policy's recent completions are judged by a labeler within a budget and the
    learned reward models keep training on them."""

    every_steps: int = 0
    """Steps between two refreshes (0 = off); the pairs come from the steps since the last one."""
    rewards: tuple[str, ...] = ()
    """Names (labels) of the reward_model / reward_model_ensemble rewards to refresh; empty = all."""
    labeler: str = ""
    """The preference source: a registered reward name or 'module:attr', called only on the pairs
    chosen for annotation; of a pair the higher-scored completion is preferred (equal = a tie,
    None = no judgement)."""
    labeler_kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the labeler's factory."""
    labels_per_refresh: int = 256
    """Annotation budget: pairs judged per refresh (ties included), shared by the refreshed RMs."""
    train_steps: int = 20
    """RM optimizer steps per refresh."""
    batch_size: int = 64
    """Pairs per RM optimizer step."""
    lr: float = 3e-4
    """AdamW learning rate of the refresh (constant)."""
    replay_share: float = 0.5
    """Share of each batch drawn from the RM's own saved training pairs (train_pairs.jsonl in its
    folder; against forgetting); the rest from every pair labelled so far in the run."""
