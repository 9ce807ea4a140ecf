"""Adapters from existing environment libraries to grpolab's environment protocol (agents/protocol.py).

- `textarena:TextArenaEnv`: a single-player TextArena game, e.g. "GuessTheNumber-v0".
- `gymnasium:GymnasiumEnv`: a Gymnasium environment with a Text or Discrete action space.

Install the libraries with the `envs` extra: pip install 'grpolab[envs]'. Each module imports its
library only when an adapter is constructed, so naming one in a config without the extra fails with
an install hint, and the rest of grpolab never needs the libraries.
"""
