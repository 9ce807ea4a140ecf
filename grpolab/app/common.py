"""What the commands share: a config by preset name or file, messages on stderr."""

from __future__ import annotations

import sys

from grpolab import config as C


def load_config(config: str, overrides: list[str]) -> C.Config:
    """The config named by `config`: a preset (grpo, dapo, ...) or a YAML file, with key=value overrides."""
    if config in C.PRESETS:
        return C.from_preset(config, overrides)
    return C.load(config, overrides)


def say(message: str) -> None:
    """One line on stderr, flushed."""
    print(message, file=sys.stderr, flush=True)
