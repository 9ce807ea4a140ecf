"""Python objects as a run's inputs: reward callables, rows in memory, a model object.

Each becomes what the config names, so the run reads it as `grpolab train` would: a reward callable is
registered under its name (rewards: [{name: NAME}]); rows are written once to a content-addressed JSONL
file in grpolab's cache (data.source=jsonl:FILE); a path becomes jsonl:PATH or hf:PATH. A model object
is handed to the trainer in place of model.name_or_path's (with the config's LoRA and checkpointing).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Iterable

from grpolab import config as C
from grpolab.errors import ConfigError

SOURCE_KINDS = ("builtin:", "jsonl:", "hf:", "rg:")


def reward_specs(rewards: Iterable[Any]) -> tuple[C.RewardSpec, ...]:
    """The config's `rewards:` entries for the Python API's rewards, registering each callable under its
    name (grpolab.rewards.registry.register_reward; a function defined again replaces the earlier one).
    Each item: a callable (weight 1, named by its `name` attribute or __name__), (callable, weight),
    (name, callable, weight), a registered reward's name, or a RewardSpec."""
    from grpolab.rewards.registry import register_reward

    specs = []
    for item in rewards:
        if isinstance(item, C.RewardSpec):
            specs.append(item)
            continue
        if isinstance(item, str):
            specs.append(C.RewardSpec.from_shorthand(item))
            continue
        name, fn, weight = _reward_parts(item)
        if not callable(fn):
            raise ConfigError(f"rewards: {item!r} is not a callable reward f(prompts, completions, metadata)")
        if isinstance(fn, type):  # a reward class: built with no arguments, as a config entry would
            register_reward(name, replace=True)(fn)
        else:
            register_reward(name, verifier=getattr(fn, "verifier", None), replace=True)(_Constant(fn))
        specs.append(C.RewardSpec(name=name, weight=float(weight)))
    return tuple(specs)


def _reward_parts(item: Any) -> tuple[str, Callable, float]:
    if isinstance(item, tuple):
        if len(item) == 2:
            fn, weight = item
            return _reward_name(fn), fn, weight
        if len(item) == 3:
            return str(item[0]), item[1], item[2]
        raise ConfigError(f"rewards: {item!r}: expected f, (f, weight) or (name, f, weight)")
    return _reward_name(item), item, 1.0


def _reward_name(fn: Any) -> str:
    name = getattr(fn, "name", None) or getattr(fn, "__name__", None) or type(fn).__name__
    if name == "<lambda>":
        raise ConfigError("rewards: a lambda has no name for the metrics; pass (name, f, weight)")
    return str(name)


class _Constant:
    """A registry factory that returns the same reward object every time it is built."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self) -> Callable:
        return self.fn


def data_source(data: Any, what: str = "data") -> str:
    """A data.source string for `data`: a source string as it is, a path as jsonl:PATH (.jsonl) or hf:PATH
    (a dataset folder or a .parquet / .arrow / .json file), rows (a list of dicts or a datasets.Dataset) as
    jsonl:FILE, FILE written once to grpolab's cache under the SHA-256 of its contents."""
    if isinstance(data, Path) or isinstance(data, str):
        text = str(data)
        if text.startswith(SOURCE_KINDS):
            return text
        if not Path(text).expanduser().exists():
            raise FileNotFoundError(f"{what}: {text!r} is neither a file nor a folder (nor builtin:, jsonl:, "
                                    "hf:, rg: source)")
        return f"jsonl:{text}" if text.endswith(".jsonl") else f"hf:{text}"
    rows = _rows(data, what)
    return f"jsonl:{rows_file(rows, what)}"


def _rows(data: Any, what: str) -> list[dict]:
    if hasattr(data, "to_list") and hasattr(data, "column_names"):  # a datasets.Dataset
        data = data.to_list()
    if not isinstance(data, (list, tuple)):
        raise ConfigError(f"{what}: a list of dicts, a datasets.Dataset, a path or a source string, got "
                          f"{type(data).__name__}")
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise ConfigError(f"{what}[{i}]: a dict per row (e.g. {{'prompt': ..., 'answer': ...}}), got "
                              f"{type(row).__name__}")
    if not data:
        raise ConfigError(f"{what}: no rows")
    return list(data)


def rows_file(rows: list[dict], what: str = "data") -> Path:
    """rows as a JSONL file in grpolab's cache (datasets/<sha256>.jsonl), written once, atomically."""
    from grpolab.models.loading import cache_root

    try:
        text = "".join(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n" for row in rows)
    except TypeError as e:
        raise ConfigError(f"{what}: every value must be JSON (str, number, bool, None, list, dict): {e}") from None
    digest = hashlib.sha256(text.encode()).hexdigest()
    path = cache_root() / "datasets" / f"{digest[:32]}.jsonl"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{digest[:8]}")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    return path


def model_inputs(model: Any) -> tuple[dict[str, str], Any, Any]:
    """(config overrides, policy, tokenizer) for the API's `model`: None -> the config's; a str or Path ->
    model.name_or_path; (PreTrainedModel, tokenizer) -> the objects themselves."""
    if model is None:
        return {}, None, None
    if isinstance(model, (str, Path)):
        return {"model.name_or_path": str(model)}, None, None
    if isinstance(model, tuple) and len(model) == 2:
        policy, tokenizer = model
        if not hasattr(policy, "forward") or tokenizer is None:
            raise ConfigError("model: (a transformers PreTrainedModel, its tokenizer)")
        return {}, policy, tokenizer
    raise ConfigError(f"model: an id, a folder, or (PreTrainedModel, tokenizer); got {type(model).__name__} (pass "
                      "the tokenizer too: model=(model, tokenizer))")
