"""An entry of `rewards:`: a reward function by name, its weight and arguments."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RewardSpec:
    """One reward function of the combined reward."""

    name: str = "exact_match"
    """A registered reward name (`grpolab.rewards.registry.reward_names()`), or 'module:attr' to load
    a reward from user code on sys.path (see grpolab.rewards.registry.build_reward for the rule)."""
    weight: float = 1.0
    """Weight in the combined reward."""
    kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the reward factory (e.g. path of a reward model). The key `verifier`
    (true/false) is reserved: it overrides whether the reward counts as a verifier (the step's
    `accuracy` metric) and is not passed to the factory."""
    label: str = ""
    """Name in metrics and reports (default: name); needed to tell two reward models apart."""
    verifier: bool | None = None
    """Whether the reward checks correctness: its 1.0 rate is the step's `accuracy`, and at weight 0 it is
    the gold that `pair_acc/RM` ranks each reward model against. None: the reward's own `verifier`
    attribute decides (e.g. `my_fn.verifier = True` in code), else false."""

    @property
    def display_name(self) -> str:
        return self.label or self.name

    @classmethod
    def from_shorthand(cls, text: str) -> "RewardSpec":
        """'name' or 'name:weight' (e.g. 'exact_match:2.0', 'mypkg.rewards:length_penalty:0.5'):
        the part after the last ':' is the weight when it reads as a number, else part of the name."""
        head, sep, tail = text.rpartition(":")
        if sep:
            try:
                return cls(name=head.strip(), weight=float(tail))
            except ValueError:
                pass
        return cls(name=text.strip())
