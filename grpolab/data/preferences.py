"""Preference pairs for reward-model training: loaded from files, or built from the arithmetic task.

A `PrefPair` is (prompt, chosen, rejected) as plain text. The reward model scores
`prompt + completion` (see grpolab.reward_models.model), exactly what a reward function gets at
GRPO time: the prompt as the policy saw it (chat template applied) and the completion text cut at
EOS. So chat rows keep the rendered prompt (`add_generation_prompt=True`) and the assistant's
content as the completion, without the template's end-of-turn text.

File rows (JSONL, or a local HF dataset read with `datasets`):
- plain text: {"prompt": str, "chosen": str, "rejected": str}; with a tokenizer that has a chat
  template the prompt is rendered as one user message (as grpolab.data.sources does);
- explicit chat prompt: {"prompt": [messages], "chosen": str | [one assistant message], ...};
- implicit chat prompt: {"chosen": [..., assistant], "rejected": [..., assistant]} (no prompt field):
  the shared messages before the final assistant message are the prompt.
Errors (DataError, a ValueError) name the file and line (or dataset row); with a tokenizer, a prompt,
chosen or rejected text it cannot encode is one of them (the character named), found when the data loads.

Built-in pairs for the arithmetic task (train or held-out side of its split, never mixed):
- `accuracy_pairs`: "is this the correct response". Answerable prompt: chosen = the answer;
  rejected = a plausible wrong number (`wrong_answer`), another number (e.g. the answer of another
  prompt), the refusal, or junk (empty, a prefix of the answer, a cut-off refusal, digit runs, ...).
  Unanswerable prompt: chosen = the refusal (the correct response when there is no answer),
  rejected = a number or junk. Training the accuracy RM on unanswerable prompts too keeps its
  scores there meaningful: otherwise it learns "refusals are bad" on answerable prompts and, at
  GRPO time, fights the refusal RM.
- `refusal_pairs`: "is refusing the right call". Unanswerable prompt: chosen = the refusal,
  rejected = an answer-like number or junk. Answerable prompt: chosen = an answer attempt (the
  correct one, or sometimes a plausible wrong one: attempting is right, correctness is the
  accuracy RM's job), rejected = the refusal.
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from grpolab.data.arith import EVAL, REFUSAL, TRAIN, ArithTask, PromptItem, wrong_answer
from grpolab.data.sources import RenderOptions, check_messages, encode_text, open_local_dataset, render_prompt

_INTEGER = re.compile(r"-?[0-9]+")


class DataError(ValueError):
    """Bad preference data; the message names the file and the line (or dataset row)."""


@dataclass(frozen=True)
class PrefPair:
    """One preference: for `prompt`, the completion `chosen` is better than `rejected`."""

    prompt: str
    chosen: str
    rejected: str


# --------------------------------------------------------------------------- files


def _completion(value: Any, field: str) -> tuple[list[dict[str, str]] | None, str]:
    """A chosen/rejected value -> (its prompt messages or None, the completion text)."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"field {field!r} is empty")
        return None, value
    if not isinstance(value, list) or not value:
        raise ValueError(f"field {field!r} must be a string or a non-empty list of messages")
    last = value[-1]
    if not isinstance(last, Mapping) or last.get("role") != "assistant" or not isinstance(last.get("content"), str):
        raise ValueError(f"field {field!r}: the last message must be an assistant message with string content")
    if not last["content"].strip():
        raise ValueError(f"field {field!r}: the assistant message is empty")
    return list(value[:-1]), last["content"]


def row_to_pair(row: Any, opts: RenderOptions) -> PrefPair:
    """One row (a dict) -> PrefPair; raises ValueError without location (the caller adds it)."""
    if not isinstance(row, Mapping):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    missing = [k for k in ("chosen", "rejected") if row.get(k) is None]
    if missing:
        raise ValueError(f"missing field(s) {missing} (fields: {', '.join(map(str, row)) or 'none'})")
    c_prefix, chosen = _completion(row["chosen"], "chosen")
    r_prefix, rejected = _completion(row["rejected"], "rejected")
    pf = opts.prompt_field
    if row.get(pf) is not None:
        if c_prefix or r_prefix:
            raise ValueError(f"has a {pf!r} field, so 'chosen'/'rejected' must hold only the assistant reply")
        prompt = row[pf]
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError(f"field {pf!r} is empty")
        else:
            prompt = check_messages(prompt)
    else:
        if c_prefix is None or r_prefix is None:
            raise ValueError(f"missing field {pf!r} (needed unless 'chosen' and 'rejected' are chat messages)")
        if c_prefix != r_prefix:
            raise ValueError("'chosen' and 'rejected' messages differ before the final assistant message")
        prompt = check_messages(c_prefix)
    if chosen == rejected:
        raise ValueError("'chosen' and 'rejected' are identical")
    pair = PrefPair(render_prompt(prompt, opts), chosen, rejected)
    if opts.tokenizer is not None:  # found when the data loads, not in the first training step
        for field, text in (("the prompt", pair.prompt), ("field 'chosen'", chosen), ("field 'rejected'", rejected)):
            encode_text(opts.tokenizer, text, field)
    return pair


def _jsonl_rows(path: Path):
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg}, column {e.colno})") from None


def load_pairs(
    path: str | os.PathLike,
    *,
    tokenizer: Any = None,
    system_prompt: str | None = None,
    prompt_field: str = "prompt",
    split: str = "train",
) -> list[PrefPair]:
    """Preference pairs from a .jsonl file, or a local dataset (a folder, .parquet, .arrow) via
    `datasets` (its `split`). Rows as in the module docstring; blank JSONL lines are skipped.

    tokenizer: renders chat prompts with its chat template (a plain prompt becomes one user message;
        `system_prompt` goes first when the row has no system message). Without a template, chat
        messages are an error.
    Raises FileNotFoundError for a missing path and DataError naming the file:line for bad rows.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"preference data not found: {p}")
    opts = RenderOptions(prompt_field=prompt_field, tokenizer=tokenizer, system_prompt=system_prompt)
    if p.is_file() and p.suffix.lower() == ".jsonl":
        rows = _jsonl_rows(p)
    elif p.is_dir() or p.suffix.lower() in (".parquet", ".arrow", ".json", ".csv"):
        try:
            ds = open_local_dataset(p, split, None)
        except ValueError as e:
            raise DataError(str(e)) from None
        rows = ((f"{p}[{split}] row {i}", row) for i, row in enumerate(ds))
    else:
        raise DataError(f"{p}: unknown preference file type {p.suffix!r}; use .jsonl, .parquet, .arrow or a folder")
    pairs = []
    for where, row in rows:
        try:
            pairs.append(row_to_pair(row, opts))
        except ValueError as e:
            raise DataError(f"{where}: {e}") from None
    if not pairs:
        raise DataError(f"{p}: no preference pairs (empty)")
    return pairs


# --------------------------------------------------------------------------- built-in (arith task)


def _junk(rng: random.Random, answer: str | None) -> str:
    """A malformed completion like a half-trained policy writes; never the correct response."""
    kinds = ["empty", "cut_refusal", "digit_run", "letters", "double_refusal", "refusal_then_number"]
    if answer is not None:
        kinds += ["answer_then_junk", "answer_repeated"] + (["answer_prefix"] if len(answer) > 1 else [])
    kind = rng.choice(kinds)
    if kind == "empty":
        return ""
    if kind == "cut_refusal":
        return REFUSAL[: rng.randint(1, len(REFUSAL) - 1)]
    if kind == "digit_run":
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(4, 12)))
    if kind == "letters":
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(rng.randint(1, 10))).strip()
        return word if word and word != REFUSAL else "x"
    if kind == "double_refusal":
        return REFUSAL + rng.choice(["", " "]) + REFUSAL[: rng.randint(1, len(REFUSAL))]
    if kind == "refusal_then_number":
        return REFUSAL + str(rng.randint(0, 150))
    if kind == "answer_then_junk":
        return answer + rng.choice(["0", "1", "5", "9", "=", " ", "+1", "c", "cannot", answer[-1]])
    if kind == "answer_repeated":
        return answer * rng.randint(2, 3)
    return answer[: rng.randint(1, len(answer) - 1)]  # answer_prefix


def _other_number(rng: random.Random, answer: str | None, peers: list[PromptItem] | None = None) -> str:
    """An integer that is not `answer`: half the time (with `peers`) the answer of another prompt of
    the same op, so that a number that is often right elsewhere (e.g. "12") is wrong here;
    otherwise one of similar size (any small one when there is no answer)."""
    if peers and rng.random() < 0.5:
        for _ in range(10):
            other = rng.choice(peers).meta["answer"]
            if other != answer:
                return other
    top = 2 * abs(int(answer)) + 20 if answer is not None else 150
    while True:
        x = str(rng.randint(0, top))
        if x != answer:
            return x


def _pools(task: ArithTask, split: str) -> tuple[list[list[PromptItem]], list[list[PromptItem]]]:
    """Prompts of one side of the split: (answerable grouped by op, unanswerable grouped by kind)."""
    if split not in (TRAIN, EVAL):
        raise ValueError(f"split must be {TRAIN!r} or {EVAL!r}, got {split!r}")
    ans: dict[str, list[PromptItem]] = {}
    una: dict[str, list[PromptItem]] = {}
    for item in task.items(split):
        if item.meta["answerable"]:
            ans.setdefault(item.meta["op"], []).append(item)
        else:
            una.setdefault(item.meta["kind"], []).append(item)
    return list(ans.values()), list(una.values())


def _draw(rng: random.Random, groups: list[list[PromptItem]], what: str) -> PromptItem:
    if not groups:
        raise ValueError(f"the task has no {what} prompts on this side of its split")
    return rng.choice(rng.choice(groups))


def _shares(rng: random.Random, n: int, share: float) -> list[bool]:
    """n flags, round(n*share) of them True, in random order (True = unanswerable prompt)."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"unanswerable_share must be in [0, 1], got {share}")
    k = round(n * share)
    flags = [True] * k + [False] * (n - k)
    rng.shuffle(flags)
    return flags


def _refuse_pair(rng: random.Random, una: list[list[PromptItem]], p_number: float) -> PrefPair:
    """An unanswerable prompt: chosen = the refusal, rejected = a number (p_number) or junk."""
    item = _draw(rng, una, "unanswerable")
    rejected = _other_number(rng, None) if rng.random() < p_number else _junk(rng, None)
    return PrefPair(item.prompt, REFUSAL, rejected)


def accuracy_pairs(
    task: ArithTask,
    rng: random.Random,
    n: int,
    *,
    split: str = TRAIN,
    unanswerable_share: float | None = None,
) -> list[PrefPair]:
    """n accuracy pairs from one side of the task's split (see the module docstring).

    Answerable prompts, rejected: 45% `wrong_answer`, 20% another number (`_other_number`), 10% the
    refusal, 25% junk. Unanswerable prompts (`unanswerable_share`, default the task's), rejected:
    60% a number, 40% junk.
    """
    ans, una = _pools(task, split)
    by_op = {group[0].meta["op"]: group for group in ans}
    share = task.unanswerable_share if unanswerable_share is None else unanswerable_share
    pairs = []
    for unanswerable in _shares(rng, n, share):
        if unanswerable:
            pairs.append(_refuse_pair(rng, una, 0.6))
            continue
        item = _draw(rng, ans, "answerable")
        answer, u = item.meta["answer"], rng.random()
        if u < 0.45:
            rejected = wrong_answer(rng, answer, task.answer_lsb_first)
        elif u < 0.65:
            rejected = _other_number(rng, answer, by_op[item.meta["op"]])
        elif u < 0.75:
            rejected = REFUSAL
        else:
            rejected = _junk(rng, answer)
        pairs.append(PrefPair(item.prompt, answer, rejected))
    return pairs


def refusal_pairs(
    task: ArithTask,
    rng: random.Random,
    n: int,
    *,
    split: str = TRAIN,
    unanswerable_share: float = 0.5,
) -> list[PrefPair]:
    """n refusal-appropriateness pairs from one side of the task's split (module docstring).

    Unanswerable prompts, rejected: 70% a number, 30% junk. Answerable prompts: chosen 70% the
    answer, 30% a plausible wrong one; rejected the refusal.
    """
    ans, una = _pools(task, split)
    pairs = []
    for unanswerable in _shares(rng, n, unanswerable_share):
        if unanswerable:
            pairs.append(_refuse_pair(rng, una, 0.7))
        else:
            item = _draw(rng, ans, "answerable")
            answer = item.meta["answer"]
            chosen = answer if rng.random() < 0.7 else wrong_answer(rng, answer, task.answer_lsb_first)
            pairs.append(PrefPair(item.prompt, chosen, REFUSAL))
    return pairs


def builtin_pair_kind(pair: PrefPair) -> str:
    """What a built-in pair tests, read from its text: "unanswerable" (chosen is the refusal),
    "refusal" (rejected is the refusal), "number" (rejected is another integer: needs arithmetic),
    or "junk" (rejected is malformed). For per-kind held-out accuracy."""
    if pair.chosen == REFUSAL:
        return "unanswerable"
    if pair.rejected == REFUSAL:
        return "refusal"
    return "number" if _INTEGER.fullmatch(pair.rejected) else "junk"
