"""The two calling conventions of a user's reward function, told apart once when the reward is built.

- grpolab's, positional: `fn(prompts, completions, metadata)`: `prompts` the N prompt texts as the
  policy saw them, `completions` the N completion texts, `metadata` N dicts, each its row's data
  fields (every field of a JSONL row but the prompt) plus `truncated` (no EOS), `completion_ids` (the
  sampled token ids while training; re-encoded by `grpolab eval`) and, while training,
  `completion_tokens` and `max_new_tokens`.
- TRL's, by keyword: `fn(prompts, completions, completion_ids, **columns)`: the same prompts and
  completions, `completion_ids` the N completions' token ids, and each metadata field as a keyword
  argument holding one value per row (None where a row lacks the field), e.g. `answer=[...]`.

`reward_style(fn)` decides from `inspect.signature`: a parameter named `metadata`, or `*args` (a
wrapper's `(*args, **kwargs)`) -> grpolab's; a `**kwargs`, a keyword-only parameter or one named
`completion_ids` -> TRL's; else grpolab's when the function takes three positional arguments, the
third without a default, TRL's when every parameter can be passed by keyword (only the keywords it
names are passed then); anything else is a ConfigError naming the reward. `KeywordReward` adapts a
TRL-style function to the positional protocol the trainer calls.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

from grpolab.errors import ConfigError

POSITIONAL, KEYWORD = "positional", "keyword"
TRL_ARGS = ("prompts", "completions", "completion_ids")
"""The keywords a TRL-style reward gets besides the data columns."""


class RewardSignatureError(RuntimeError):
    """A reward's parameters do not fit what the data offers (e.g. a column no row has)."""


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else getattr(fn, "__call__", fn)
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):  # a builtin without a signature: taken as grpolab's
        return None


def reward_style(fn: Callable[..., Any], name: str) -> str:
    """POSITIONAL or KEYWORD (module docstring); ConfigError naming the reward when neither fits."""
    sig = _signature(fn)
    if sig is None:
        return POSITIONAL
    params = sig.parameters.values()
    names = {p.name for p in params}
    kinds = {p.kind for p in params}
    if "metadata" in names:
        return POSITIONAL
    if inspect.Parameter.VAR_POSITIONAL in kinds and inspect.Parameter.KEYWORD_ONLY not in kinds \
            and "completion_ids" not in names:  # e.g. a wrapper's (*args, **kwargs): TRL passes no positionals
        return POSITIONAL
    if inspect.Parameter.VAR_KEYWORD in kinds or inspect.Parameter.KEYWORD_ONLY in kinds or "completion_ids" in names:
        if inspect.Parameter.POSITIONAL_ONLY in kinds:
            raise ConfigError(f"rewards: reward {name!r}{sig}: TRL-style rewards are called by keyword; "
                              "positional-only parameters cannot be passed")
        return KEYWORD
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    third_required = len(positional) >= 3 and positional[2].default is inspect.Parameter.empty
    if third_required or (len(positional) < 3 and inspect.Parameter.VAR_POSITIONAL in kinds):
        try:
            sig.bind(None, None, None)
            return POSITIONAL
        except TypeError:
            pass
    if inspect.Parameter.POSITIONAL_ONLY not in kinds and inspect.Parameter.VAR_POSITIONAL not in kinds:
        return KEYWORD
    raise ConfigError(f"rewards: reward {name!r} has the signature {sig}, which fits neither grpolab's "
                      "fn(prompts, completions, metadata) nor TRL's fn(prompts, completions, **columns)")


class KeywordReward:
    """A TRL-style reward function called through grpolab's positional protocol (module docstring).

    The signature is read once here; each call builds the column lists from the rows' metadata.
    """

    def __init__(self, fn: Callable[..., Any], name: str):
        self.fn = fn
        self.name = getattr(fn, "name", None) or name
        self.verifier = getattr(fn, "verifier", False)
        sig = _signature(fn)
        params = list(sig.parameters.values()) if sig is not None else []
        self.takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        named = [p for p in params if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)]
        self.accepted = {p.name for p in named}
        self.required = [p.name for p in named if p.default is inspect.Parameter.empty]

    def __call__(self, prompts: Sequence[str], completions: Sequence[str],
                 metadata: Sequence[dict[str, Any]]) -> list[float | None]:
        return self.fn(**self.arguments(prompts, completions, metadata))

    def arguments(self, prompts: Sequence[str], completions: Sequence[str],
                  metadata: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The keyword arguments of one call: TRL_ARGS and one list per metadata field."""
        keys = list(dict.fromkeys(k for m in metadata for k in m))
        columns = {k: [m.get(k) for m in metadata] for k in keys if k not in TRL_ARGS}
        kwargs: dict[str, Any] = {"prompts": list(prompts), "completions": list(completions)}
        if "completion_ids" in keys:
            kwargs["completion_ids"] = [m.get("completion_ids") for m in metadata]
        kwargs.update(columns)
        missing = [p for p in self.required if p not in kwargs]
        if missing:
            have = ", ".join(sorted(k for k in kwargs if k not in TRL_ARGS)) or "none"
            raise RewardSignatureError(
                f"reward {self.name!r} takes {', '.join(missing)}, which the rows do not have (their fields: "
                f"{have}); name a parameter after a data field, give it a default, or take **kwargs")
        return kwargs if self.takes_all else {k: v for k, v in kwargs.items() if k in self.accepted}

    def __repr__(self) -> str:
        return f"KeywordReward({self.fn!r}, name={self.name!r})"
