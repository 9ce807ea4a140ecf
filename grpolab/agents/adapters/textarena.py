"""`TextArenaEnv`: a single-player TextArena game (pip install 'grpolab[envs]') as a grpolab environment.

    environment:
      name: grpolab.agents.adapters.textarena:TextArenaEnv
      kwargs: {env_id: "GuessTheNumber-v0", env_kwargs: {max_turns: 8}}

Each episode makes the game with `textarena.make(env_id, **env_kwargs)` and starts it with
`reset(num_players=1, seed=item["seed"])`, so a data row {"seed": 7} always opens the same game.
The policy's assistant message is the game's action, given to the game unchanged (TextArena's own
action wrappers of `env_id` still apply, e.g. "[5]" formatting).

What the model sees: every observation the game adds for the player (its prompt, board, hints and
"invalid move" notices), in order, joined into one user message per turn. The player's own action,
which TextArena echoes back, is left out (the chat already holds it as the assistant message). The
observation wrappers that TextArena puts on its default ids render the whole history into one text
each turn; the chat keeps the history here, so the adapter reads the game's own observations instead.
When the game ends, the reason it gives (a win, the turn limit, a second invalid move in a row)
is the last user message, and its reward for the player is the step's reward; every earlier step's
reward is None, as TextArena scores a game only when it closes.

Games that need a download at `make` or `reset` (e.g. Wordle's nltk word lists) fail without network;
GuessTheNumber runs offline. TextArena's games draw from Python's global `random`, which its reset
seeds: the adapter gives each episode its own generator state and restores the global one after
every call, so concurrent episodes and the rest of the process do not disturb one another.
"""

from __future__ import annotations

import contextlib
import random
import threading
from typing import Any, Iterator

from grpolab.agents.adapters.common import item_seed, require_library

_PLAYER = 0
_RANDOM_LOCK = threading.Lock()
"""Held while a game runs on its own `random` state: episodes stepped in threads (env workers) take turns."""


class TextArenaEnv:
    """A single-player TextArena game, one instance per episode.

    env_id: a TextArena id, e.g. "GuessTheNumber-v0" (its "-raw" and "-train" variants work too).
    env_kwargs: keyword arguments of `textarena.make` for the game's constructor, e.g. {"max_turns": 8}.
    """

    def __init__(self, env_id: str, env_kwargs: dict | None = None):
        self._ta = require_library("textarena", "grpolab.agents.adapters.textarena:TextArenaEnv")
        self.env_id, self.env_kwargs = env_id, dict(env_kwargs or {})
        self.env: Any = None
        self.done = True
        self._random_state: Any = None

    @contextlib.contextmanager
    def _own_random(self) -> Iterator[None]:
        """Runs a library call on this episode's `random` state; the global state is put back after."""
        with _RANDOM_LOCK:
            outside = random.getstate()
            if self._random_state is not None:
                random.setstate(self._random_state)
            try:
                yield
            finally:
                self._random_state = random.getstate()
                random.setstate(outside)

    def reset(self, item: Any) -> list[dict[str, str]]:
        """Makes and starts the game (seeded by item["seed"] when there is one); returns its opening
        observations as one user message."""
        seed = item_seed(item, f"TextArenaEnv({self.env_id!r})")
        self._random_state = None
        with self._own_random():
            self.env = self._ta.make(self.env_id, **self.env_kwargs)
            self.env.reset(num_players=1, seed=seed)
        self.done = False
        return self._observations([])

    def step(self, message: dict[str, str]) -> tuple[list[dict[str, str]], float | None, bool]:
        """Plays the assistant message as the player's action; returns the game's reply, the reward
        (None until the game ends) and whether it ended."""
        if self.done:
            raise RuntimeError(f"TextArenaEnv({self.env_id!r}): step after the game ended (reset first)")
        with self._own_random():
            done, _info = self.env.step(message["content"])
        if not done:
            return self._observations([]), None, False
        self.done = True
        with self._own_random():
            rewards, game_info = self.env.close()
        reason = (game_info or {}).get(_PLAYER, {}).get("reason")
        reward = (rewards or {}).get(_PLAYER)  # None: the game ended without scoring the player
        return self._observations([reason] if reason else []), None if reward is None else float(reward), True

    def _observations(self, extra: list[str]) -> list[dict[str, str]]:
        """The game's new observations for the player (without the echo of its own action), then
        `extra`, as one user message; no message when there is nothing new."""
        base = self.env
        while isinstance(base, self._ta.Wrapper):  # read past the wrappers that render whole histories
            base = base.env
        player, observations = base.get_observation()
        if player != _PLAYER:
            raise RuntimeError(f"TextArenaEnv({self.env_id!r}): the game expects player {player}; "
                               "only single-player games are supported")
        own_action = self._ta.ObservationType.PLAYER_ACTION
        texts = [text for sender, text, kind in observations if not (kind == own_action and sender == _PLAYER)]
        texts = [t.strip() for t in texts + extra if t and t.strip()]
        return [{"role": "user", "content": "\n\n".join(texts)}] if texts else []
