"""The `environment:` section: the environment agent episodes run in (grpolab.agents)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EnvironmentConfig:
    """An environment of multi-turn episodes (grpolab/agents/protocol.py): reset(item) -> messages,
    step(assistant message) -> (messages, reward or None, done). Empty name: no environment (plain
    completions, or tool episodes opened by the prompts themselves when rollout.tools is set)."""

    name: str = ""
    """'pkg.mod:Class' of the environment class, e.g. 'grpolab.agents.builtin:GuessNumber'. One fresh
    instance per episode; each data row (a dict) is the `item` its reset gets."""
    kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the environment's constructor."""
    reward_weight: float = 1.0
    """Weight of the environment's reward (the sum of an episode's step rewards) in the combined reward,
    beside the weights of `rewards:` (which then score the episode's last assistant message, with the
    transcript in their metadata). In metrics it is the reward named `environment`."""
