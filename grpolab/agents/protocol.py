"""The environment of an agent episode: the `Environment` protocol, `StepResult`, and loading one by name.

An episode alternates policy turns and environment turns. The environment speaks in
chat messages: dicts with a "role" ("system" | "user" | "assistant" | "tool") and a "content" str
(other keys, e.g. a tool message's "name", are passed to the chat template unchanged).

    env = factory()                       # one instance per episode: environments keep state
    messages = env.reset(item)            # the opening messages (system, user, ...)
    messages, reward, done = env.step({"role": "assistant", "content": text})

`reward` is None when the step gives none (e.g. a reward only at the end); the rewards of an
episode are summed unless an estimator says otherwise. After `done`, `step` is not called again.

Config: `environment: {name: "pkg.mod:Class", kwargs: {...}}` -> `load_environment(name, kwargs)`,
which checks the class and its kwargs once and returns a factory that makes a fresh environment per
episode. Errors are ConfigError naming the spec.

An environment that raises ends its episode; `describe_error` is the one line the episode keeps.
An environment run elsewhere (agents/envworkers.py) raises `EnvironmentFailure` with that line
already written, so the episode records the same text as in this process.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Callable, Mapping, NamedTuple, Protocol, runtime_checkable

from grpolab.errors import ConfigError
from grpolab.imports import import_object

Message = dict[str, Any]
"""A chat message: {"role": str, "content": str, ...}."""


class EnvironmentFailure(Exception):
    """An environment call that failed, its description complete (`describe_error` takes it as is)."""


def describe_error(error: BaseException, where: str) -> str:
    """One line naming the environment (`where`) and what it raised."""
    if isinstance(error, EnvironmentFailure):
        return str(error)
    return f"{where} raised {type(error).__name__}: {' '.join(str(error).split())[:300]}"


class StepResult(NamedTuple):
    """What one environment step returns: its messages (may be empty), a reward or None, done."""

    messages: list[Message]
    reward: float | None
    done: bool


@runtime_checkable
class Environment(Protocol):
    """A stateful environment for one episode at a time."""

    def reset(self, item: Any) -> list[Message]:
        """Starts an episode for `item` (a data row, e.g. {"seed": 3}); returns the opening messages."""
        ...

    def step(self, message: Message) -> tuple[list[Message], float | None, bool]:
        """Takes the policy's assistant message; returns (messages to append, reward or None, done)."""
        ...


def check_messages(messages: Any, where: str) -> list[Message]:
    """`messages` if it is a list of {role: str, content: str, ...} dicts; TypeError naming `where` otherwise."""
    if not isinstance(messages, list):
        raise TypeError(f"{where}: expected a list of messages, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise TypeError(f"{where}: message {i} must be a dict with str 'role' and 'content', got {m!r}"[:300])
    return [dict(m) for m in messages]


def as_step_result(value: Any, where: str) -> StepResult:
    """An environment's `step` return value, checked: a 3-tuple (messages, finite reward or None,
    bool done). TypeError naming `where` (e.g. the environment class) otherwise."""
    if not isinstance(value, tuple) or len(value) != 3:
        raise TypeError(f"{where}.step must return (messages, reward, done), got {value!r}"[:300])
    messages, reward, done = value
    messages = check_messages(messages, f"{where}.step")
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise TypeError(f"{where}.step: reward must be a finite number or None, got {reward!r}")
        reward = float(reward)
    if not isinstance(done, bool):
        raise TypeError(f"{where}.step: done must be a bool, got {done!r}")
    return StepResult(messages, reward, done)


def load_environment(spec: str, kwargs: Mapping[str, Any] | None = None) -> Callable[[], Environment]:
    """The environment class that `spec` ('pkg.mod:Class') names, bound to `kwargs`.

    Returns a zero-argument factory: each call makes a fresh environment (one per concurrent
    episode). Checked here, once: the module and attribute exist, the attribute is a class with
    callable `reset` and `step`, and `kwargs` fit its constructor's signature. ConfigError naming
    the spec otherwise.
    """
    what = f"environment {spec!r}"
    cls = import_object(spec, what, example="mypkg.envs:MyEnv")
    if not inspect.isclass(cls):
        raise ConfigError(f"{what}: is a {type(cls).__name__}, not a class with reset(item) and step(message)")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError(f"{what}: class {cls.__name__} has no method {' or '.join(missing)} (an environment "
                          "needs reset(item) -> messages and step(message) -> (messages, reward, done))")
    kwargs = dict(kwargs or {})
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{what}: bad kwargs {kwargs}: {e}") from None
    except ValueError:  # no signature to read (a builtin-backed class): the first call will tell
        pass
    return functools.partial(cls, **kwargs)
