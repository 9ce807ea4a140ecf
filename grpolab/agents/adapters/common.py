"""What the adapters share: reading the seed of an item, and importing a library of the `envs` extra."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from grpolab.errors import ConfigError
from grpolab.optional import MissingExtraError, require

EXTRA = "envs"
"""The pyproject extra that installs the adapted libraries."""


def item_seed(item: Any, where: str) -> int | None:
    """The seed of a data row: item["seed"] (an int), None for a row without one (the library's own
    unseeded start). ValueError naming `where` for a seed that is not an int."""
    seed = item.get("seed") if isinstance(item, dict) else None
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"{where}: item['seed'] must be an int, got {seed!r}"[:200])
    return seed


def require_library(module: str, adapter: str) -> ModuleType:
    """`module` imported, or a ConfigError naming the adapter and the extra that installs it."""
    try:
        return require(module, EXTRA)
    except MissingExtraError as e:
        raise ConfigError(f"environment {adapter}: {e}") from None
