"""Rule-based rewards for tasks with a gold answer and unanswerable prompts (e.g. grpolab.data.arith).

Each reward gets completions already cut at the first EOS (EOS not included) and one metadata row
per completion with the task's keys `answer` (str, or None when unanswerable) and `answerable`
(bool), plus `truncated` (bool: the completion hit the token limit without EOS). A truncated
completion never counts: it gets the reward's "wrong" value. Answers are compared after `.strip()`.

- `exact_match`: answerable rows 1.0 if the completion is the answer else 0.0; unanswerable rows None.
- `refusal`: 1.0 for the right call (refuse an unanswerable prompt, answer an answerable one), else 0.0.
- `format`: 1.0 if the completion is an integer or the refusal and ended with EOS, else 0.0.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from grpolab.data.arith import REFUSAL

_INTEGER = re.compile(r"0|-?[1-9][0-9]*")


def is_refusal(text: str, refusal: str = REFUSAL) -> bool:
    """True when the completion (without EOS) is exactly the refusal string, up to outer whitespace."""
    return text.strip() == refusal


def is_integer(text: str) -> bool:
    """True for a canonical integer: "0", "82", "-5" (no sign on zero, no leading zeros)."""
    return _INTEGER.fullmatch(text.strip()) is not None


def is_correct(text: str, meta: dict[str, Any], refusal: str = REFUSAL) -> bool:
    """The right behaviour for the prompt: the exact answer if answerable, the refusal if not.

    False when `meta` says the completion was truncated (`truncated` may be absent: not truncated).
    """
    if meta.get("truncated", False):
        return False
    if meta["answerable"]:
        return text.strip() == meta["answer"]
    return is_refusal(text, refusal)


def _check_rows(
    name: str, completions: Sequence[str], metadata: Sequence[dict[str, Any]], keys: tuple[str, ...]
) -> None:
    """ValueError naming the reward and the row when metadata rows are missing or lack `keys`."""
    if len(metadata) != len(completions):
        raise ValueError(f"reward {name!r}: {len(completions)} completions but {len(metadata)} metadata rows")
    for i, row in enumerate(metadata):
        missing = [k for k in keys if k not in row]
        if missing:
            raise ValueError(f"reward {name!r}: metadata row {i} lacks {missing} (has {sorted(row)})")
        if "answer" in keys and row["answerable"] and not isinstance(row["answer"], str):
            raise ValueError(f"reward {name!r}: metadata row {i} is answerable but its answer is {row.get('answer')!r}")


class ExactMatch:
    """Correctness: 1.0 / 0.0 on answerable rows (truncated = 0.0); abstains (None) on unanswerable rows."""

    name = "exact_match"
    verifier = True

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[dict[str, Any]]
    ) -> list[float | None]:
        _check_rows(self.name, completions, metadata, ("answerable", "answer", "truncated"))
        return [
            None if not row["answerable"] else float(not row["truncated"] and text.strip() == row["answer"])
            for text, row in zip(completions, metadata)
        ]


class Refusal:
    """Refusal appropriateness: refuse exactly the unanswerable prompts. Truncated = 0.0."""

    name = "refusal"
    verifier = False

    def __init__(self, refusal: str = REFUSAL):
        self.refusal = refusal

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[dict[str, Any]]
    ) -> list[float | None]:
        _check_rows(self.name, completions, metadata, ("answerable", "truncated"))
        return [
            float(not row["truncated"] and is_refusal(text, self.refusal) != row["answerable"])
            for text, row in zip(completions, metadata)
        ]


class Format:
    """Well-formedness: an integer or the refusal string, ended with EOS (not truncated)."""

    name = "format"
    verifier = False

    def __init__(self, refusal: str = REFUSAL):
        self.refusal = refusal

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[dict[str, Any]]
    ) -> list[float | None]:
        _check_rows(self.name, completions, metadata, ("truncated",))
        return [
            float(not row["truncated"] and (is_integer(text) or is_refusal(text, self.refusal)))
            for text, row in zip(completions, metadata)
        ]
