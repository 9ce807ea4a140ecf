"""`GymnasiumEnv`: a Gymnasium environment (pip install 'grpolab[envs]') as a grpolab environment.

    environment:
      name: grpolab.agents.adapters.gymnasium:GymnasiumEnv
      kwargs: {env_id: "FrozenLake-v1", env_kwargs: {is_slippery: false, render_mode: ansi},
               instructions: "Reach G without falling into a hole H. Actions: 0 left, 1 down, 2 right, 3 up."}

Each episode makes the environment with `gymnasium.make(env_id, **env_kwargs)` and starts it with
`reset(seed=item["seed"])`, so a data row {"seed": 7} always opens the same episode.

Actions: with a `Text` action space the assistant message is the action, unchanged; with a
`Discrete` one the action is the last integer the message writes. A message that gives no action
inside the space is not played: the reply names the action space (Gymnasium's own description of
it, e.g. "Discrete(4)"), the reward is None and the episode goes on. Other action spaces are refused
when the adapter is made.

Observations, as one user message per step: a str observation as it is; otherwise the environment's
text rendering when `render_mode` is "ansi" (terminal colour codes removed), followed by
"Observation: <value>", so the value that the colours marked is still there. The step's reward is
Gymnasium's; done is terminated or truncated (gymnasium.make's time limit included). The step's
`info` dict is not shown to the model.
"""

from __future__ import annotations

import re
from typing import Any

from grpolab.agents.adapters.common import item_seed, require_library
from grpolab.agents.builtin import last_integer
from grpolab.errors import ConfigError

_SPEC = "grpolab.agents.adapters.gymnasium:GymnasiumEnv"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class GymnasiumEnv:
    """A Gymnasium environment with a Text or Discrete action space, one instance per episode.

    env_id: a registered Gymnasium id, e.g. "FrozenLake-v1" (or "pkg.module:Env-v0", which imports pkg).
    env_kwargs: keyword arguments of `gymnasium.make`, e.g. {"render_mode": "ansi", "is_slippery": False}.
    instructions: text put before the first observation (the task and what the actions mean);
    default: a line naming the action space.
    """

    def __init__(self, env_id: str, env_kwargs: dict | None = None, instructions: str | None = None):
        self._gym = require_library("gymnasium", _SPEC)
        self.env_id, self.env_kwargs = env_id, dict(env_kwargs or {})
        self.env = self._gym.make(env_id, **self.env_kwargs)
        spaces = self._gym.spaces
        if not isinstance(self.env.action_space, (spaces.Text, spaces.Discrete)):
            self.env.close()
            raise ConfigError(f"environment {_SPEC} ({env_id!r}): action space {self.env.action_space} is neither "
                              "Text nor Discrete, so an assistant message cannot be read as its action")
        self.instructions = instructions if instructions is not None else self._actions_line()
        self.done = True

    def _actions_line(self) -> str:
        space = self.env.action_space
        if isinstance(space, self._gym.spaces.Discrete):
            return f"Reply with an action: an integer from {space.start} to {space.start + space.n - 1}."
        return f"Reply with an action: a text of the space {space}."

    def reset(self, item: Any) -> list[dict[str, str]]:
        """Starts an episode (seeded by item["seed"] when there is one); returns the instructions and
        the first observation as one user message."""
        observation, _info = self.env.reset(seed=item_seed(item, f"GymnasiumEnv({self.env_id!r})"))
        self.done = False
        text = "\n\n".join(t for t in (self.instructions.strip(), self._observation_text(observation)) if t)
        return [{"role": "user", "content": text}]

    def step(self, message: dict[str, str]) -> tuple[list[dict[str, str]], float | None, bool]:
        """Plays the action the assistant message gives; returns the next observation, the reward and
        whether the episode ended. A message without a valid action is answered and not played."""
        if self.done:
            raise RuntimeError(f"GymnasiumEnv({self.env_id!r}): step after the episode ended (reset first)")
        action = self._action(message["content"])
        if action is None:
            reply = f"Invalid action {message['content'][-200:]!r}: the action space is {self.env.action_space}."
            return [{"role": "user", "content": reply}], None, False
        observation, reward, terminated, truncated, _info = self.env.step(action)
        self.done = bool(terminated or truncated)
        return [{"role": "user", "content": self._observation_text(observation)}], float(reward), self.done

    def _action(self, text: str) -> Any:
        """The action of the space that `text` gives, None when it gives none."""
        space = self.env.action_space
        if isinstance(space, self._gym.spaces.Discrete):
            value = last_integer(text)
            in_range = value is not None and int(space.start) <= value < int(space.start) + int(space.n)
            action = space.dtype.type(value) if in_range else None  # a huge integer would overflow the dtype
        else:
            action = text
        return action if action is not None and space.contains(action) else None

    def _observation_text(self, observation: Any) -> str:
        if isinstance(observation, str):
            return observation
        lines = []
        if self.env.render_mode == "ansi":
            lines.append(_ANSI.sub("", str(self.env.render())).strip())
        lines.append(f"Observation: {observation}")
        return "\n".join(line for line in lines if line)
