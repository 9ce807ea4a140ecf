"""User code named in a config as 'module:attr': one importer for rewards, environments and tools."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from grpolab.errors import ConfigError


def import_module(module_name: str):
    """importlib.import_module, with the working directory on sys.path as `python -m` has it: a
    `grpolab` console script starts without it, and a config's own module usually lies there."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        cwd = os.getcwd()
        if e.name != module_name.split(".")[0] or cwd in sys.path or "" in sys.path:
            raise
        sys.path.insert(0, cwd)
        return importlib.import_module(module_name)


def import_object(spec: str, what: str, example: str = "mypkg.mod:name") -> Any:
    """The object that 'module:attr' names (attr may be dotted). ConfigError starting with `what`
    (e.g. "environment 'pkg.mod:Env'") when the spec is malformed, the module is missing or fails to
    import, or the attribute is missing."""
    module_name, _, attr = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not module_name or not attr:
        raise ConfigError(f"{what}: expected 'module:attr', e.g. {example!r}, got {spec!r}")
    try:
        obj = import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ConfigError(f"{what}: no module named {e.name!r} (is it on sys.path or PYTHONPATH?)") from None
        raise ConfigError(f"{what}: importing module {module_name!r} failed: {e}") from e
    except Exception as e:  # noqa: BLE001 - user code may raise anything while importing
        raise ConfigError(f"{what}: importing module {module_name!r} failed: {type(e).__name__}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{what}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj
