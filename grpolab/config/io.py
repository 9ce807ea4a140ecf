"""Building config objects from YAML and dotted overrides, and type checking.

Kept apart from the section modules so that the dataclasses read as plain documentation. This
module does not import the Config classes: it works on whatever dataclass it is handed
(config/config.py passes its classes and presets in), so the dependency runs one way.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Mapping

import yaml

from grpolab.errors import ConfigError


def _err(msg: str) -> ConfigError:
    return ConfigError(msg)


# ----------------------------------------------------------------------------- typing helpers
def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, tp: Any, where: str, lines=None, source: str = "") -> Any:
    """Checks `value` against the annotation `tp`; returns it (ints accepted for floats)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except Exception:
                continue
        raise _err(f"{where}: expected {tp}, got {value!r}")
    if tp is bool:
        if not isinstance(value, bool):
            raise _err(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _err(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _err(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _err(f"{where}: expected a string, got {value!r}")
        return value
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise _err(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if origin is tuple:
        (inner, _ellipsis) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise _err(f"{where}: expected a list, got {value!r}")
        if dataclasses.is_dataclass(inner):
            return tuple(_element(inner, v, f"{where}[{i}]", lines, source) for i, v in enumerate(value))
        return tuple(_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        return build(tp, value, where, lines, source)
    raise _err(f"{where}: unsupported type {tp}")


def _element(cls, value: Any, where: str, lines=None, source: str = ""):
    """One dataclass element of a list field: an instance, a mapping, or a string that the class
    parses itself (`cls.from_shorthand`, e.g. RewardSpec's "name:weight")."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str) and hasattr(cls, "from_shorthand"):
        return cls.from_shorthand(value)
    return build(cls, value, where, lines, source)


def build(cls, data: Any, where: str = "", lines: dict[str, int] | None = None, source: str = ""):
    """Builds dataclass `cls` from a mapping, rejecting unknown keys and wrong types."""
    if dataclasses.is_dataclass(data) and isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise _err(f"{_loc(where, lines, source)}: expected a mapping for {cls.__name__}, got {data!r}")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" Did you mean {(where + '.' if where else '') + close[0]!r}?" if close else ""
            raise _err(f"{_loc(path, lines, source)}: unknown field {path!r}.{hint} Fields here: {', '.join(names)}")
        if dataclasses.is_dataclass(hints[key]) or typing.get_origin(hints[key]) is tuple:
            kwargs[key] = _coerce(value, hints[key], path, lines, source)  # located inside
            continue
        try:
            kwargs[key] = _coerce(value, hints[key], path)
        except Exception as e:  # re-raise with file:line
            msg = str(e)
            raise _err(f"{_loc(path, lines, source)}: {msg.split(': ', 1)[-1]}" if lines else msg) from None
    return cls(**kwargs)


def _loc(path: str, lines: dict[str, int] | None, source: str) -> str:
    if lines and source:
        ln = lines.get(path) or lines.get(path.rsplit(".", 1)[0])
        if ln:
            return f"{source}:{ln}: {path}"
    return path


# ----------------------------------------------------------------------------- YAML
def key_lines(text: str) -> dict[str, int]:
    """Dotted key -> 1-based line number, from the YAML node tree."""
    out: dict[str, int] = {}

    def walk(node, prefix):
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = f"{prefix}.{k.value}" if prefix else str(k.value)
                out[key] = k.start_mark.line + 1
                walk(v, key)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                walk(v, f"{prefix}[{i}]")

    try:
        walk(yaml.compose(text), "")
    except yaml.YAMLError:
        pass
    return out


def check_duplicate_keys(text: str, source: str) -> None:
    """A ConfigError naming both lines when a mapping of the YAML `text` repeats a key (YAML loaders
    silently keep the last one)."""
    def walk(node, prefix):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for k, v in node.value:
                key = f"{prefix}.{k.value}" if prefix else str(k.value)
                line = k.start_mark.line + 1
                if k.value in seen:
                    raise _err(f"{source}:{line}: {key}: duplicate key (first at line {seen[k.value]}); "
                               "keep one of them")
                seen[k.value] = line
                walk(v, key)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                walk(v, f"{prefix}[{i}]")

    try:
        walk(yaml.compose(text), "")
    except yaml.YAMLError:
        pass


def load_yaml(path: str, overrides: list[str], config_cls, presets: dict[str, dict[str, Any]]):
    """A `config_cls` from a YAML file: the file's `preset:` (default "grpo", a key of `presets`)
    gives the starting values, the file's sections replace them field by field, then `overrides`."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise _err(f"config file {path!r} cannot be read: {e.strerror}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        raise _err(f"{where}: not valid YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise _err(f"{path}:1: the config must be a mapping of sections (model:, rollout:, ...)")
    check_duplicate_keys(text, path)
    return from_mapping(data, overrides, config_cls, presets, key_lines(text), path)


def from_mapping(data: dict, overrides: list[str], config_cls, presets: dict[str, dict[str, Any]],
                 lines: dict[str, int] | None = None, source: str = "", default_preset: str = "grpo"):
    """A `config_cls` from parsed YAML sections: `preset:` (default `default_preset`) gives the starting
    values, the sections replace them field by field, then `overrides`. lines (dotted key -> line of
    `source`) lets errors name the file and line."""
    lines = lines or {}
    preset = data.get("preset", default_preset)
    if not isinstance(preset, str) or preset not in presets:
        where = f"{source}:{lines.get('preset', 1)}: " if source else ""
        raise _err(f"{where}preset: unknown preset {preset!r}; choose one of {', '.join(presets)}")
    base = apply_overrides(config_cls(preset=preset), override_strings(presets[preset]))
    cfg = build(config_cls, _merge(dataclasses.asdict(base), data), "", lines, source)
    return apply_overrides(cfg, overrides)


def override_strings(values: dict[str, Any]) -> list[str]:
    """{dotted field: value} (e.g. a preset) as `key=value` override strings."""
    return [f"{k}={dump_value(v)}" for k, v in values.items()]


def _merge(base: dict, new: dict) -> dict:
    """`new` over `base`, mappings merged key by key (except reward kwargs); lists are replaced."""
    out = dict(base)
    for k, v in new.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "kwargs" else v
    return out


def dump_value(v: Any) -> str:
    return yaml.safe_dump(v, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def dump_yaml(cfg) -> str:
    d = dataclasses.asdict(cfg)
    d["rewards"] = [dict(r) for r in d["rewards"]]
    return yaml.safe_dump(d, sort_keys=False)


def apply_overrides(cfg, overrides: list[str]):
    """Applies 'section.field=value' strings (values parsed as YAML) to a config dataclass, returning a new one.

    A key inside a free-form mapping field (e.g. `environment.kwargs.env_id=...`) sets that entry,
    creating it (and the mappings above it) when absent; any other unknown key is an error naming it.
    """
    config_cls = type(cfg)
    d = dataclasses.asdict(cfg)
    for ov in overrides:
        key, sep, raw = ov.partition("=")
        if not sep or not key.strip():
            raise _err(f"override {ov!r}: expected key=value, e.g. loss.clip_eps_high=0.28")
        key = key.strip()
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        _set_override(config_cls, d, cfg, key.split("."), value)
    return build(config_cls, d, "")


def _set_override(config_cls, d: dict, cfg, parts: list[str], value: Any) -> None:
    """Sets `parts` (a dotted key) to `value` in `d` (cfg as dicts), walking cfg's dataclasses alongside
    to tell a config section (known fields only) from a free-form mapping (any key)."""
    node, obj = d, cfg
    for i, p in enumerate(parts):
        last = i == len(parts) - 1
        if dataclasses.is_dataclass(obj) and isinstance(node, dict) and p in node:
            if last:
                node[p] = value
            else:
                node, obj = node[p], getattr(obj, p)
        elif isinstance(obj, Mapping) and isinstance(node, dict):
            if last:
                node[p] = value
            else:
                if not isinstance(node.get(p), dict):
                    node[p] = {}
                node = obj = node[p]
        else:
            build(config_cls, _set_unknown(d, parts[: i + 1]), "")  # raises with a hint
            raise _err(f"override {'.'.join(parts)}: {'.'.join(parts[: i + 1])} is not a config field")


def _set_unknown(d: dict, parts: list[str]) -> dict:
    """A copy of d with the unknown key inserted, so that `build` reports it with a suggestion."""
    out = dict(d)
    node = out
    for p in parts[:-1]:
        node[p] = dict(node[p]) if isinstance(node.get(p), dict) else {}
        node = node[p]
    node[parts[-1]] = None
    return out
