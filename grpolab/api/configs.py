"""`make_config`: a Config from a preset, a YAML file, a dict or a Config, plus overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from grpolab import config as C
from grpolab.errors import ConfigError

Overrides = Sequence[str] | Mapping[str, Any] | None
"""`["section.field=value", ...]` as on the command line, or `{"section.field": value}`."""


def override_list(overrides: Overrides) -> list[str]:
    """Overrides as `key=value` strings (a mapping's values written as YAML, as the command line reads them)."""
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        from grpolab.config.io import override_strings

        return override_strings(dict(overrides))
    if isinstance(overrides, str):
        raise ConfigError(f"overrides: a list of 'key=value' strings or a dict, got the string {overrides!r}")
    return [str(o) for o in overrides]


def make_config(source: C.Config | str | Path | Mapping[str, Any] | None = None, overrides: Overrides = None,
                ) -> C.Config:
    """The validated Config of `source` with `overrides` applied.

    source: a preset name (grpo, dapo, sft, ...; None: grpo), a YAML file, a mapping shaped like the
    YAML file (`{"preset": "dapo", "train": {"steps": 10}}`), or a Config (returned with the overrides).
    Errors name the field (and, for a file, the line) as the command line's do."""
    ov = override_list(overrides)
    if source is None:
        source = "grpo"
    if isinstance(source, C.Config):
        return _apply(source, ov)
    if isinstance(source, Mapping):
        from grpolab.config.io import from_mapping

        return from_mapping(dict(source), ov, C.Config, C.PRESETS).validate()
    if isinstance(source, (str, Path)):
        name = str(source)
        return C.from_preset(name, ov) if name in C.PRESETS else C.load(name, ov)
    raise ConfigError(f"config: a preset name, a YAML path, a dict or a Config, got {type(source).__name__}")


def _apply(cfg: C.Config, overrides: list[str]) -> C.Config:
    from grpolab.config.io import apply_overrides

    return apply_overrides(cfg, overrides).validate()
