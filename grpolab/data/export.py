"""The built-in arithmetic task as JSONL files, the formats a user's own data comes in.

`grpolab data --out DIR [CONFIG] [overrides]` writes, from the task's split (data.seed, data.arith_*):

    sft.jsonl                       {"prompt", "response"}: SFT pairs (sft.examples, sft.refusal_*)
    prompts.jsonl                   {"prompt", "answer", "answerable", "op", "kind"}: GRPO prompts
    heldout.jsonl                   the same fields: the held-out prompts (data.eval_prompts)
    accuracy_pairs.jsonl            {"prompt", "chosen", "rejected"}: "is this the correct response"
    accuracy_pairs_heldout.jsonl    the same, on held-out prompts
    refusal_pairs.jsonl             "is refusing the right call"
    refusal_pairs_heldout.jsonl     the same, on held-out prompts

Training files come from the task's training side only and held-out files from its held-out
side (grpolab.data.arith), so the files keep the split the built-in pipeline keeps. Pairs with an
empty completion (one kind of junk the built-in pairs use) are left out: preference files hold
non-empty completions (grpolab.data.preferences). The output is a function of the config and the
counts: the same command writes the same bytes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from grpolab.data.arith import BUILTIN_SFT_EXAMPLES, EVAL, TRAIN
from grpolab.data.build import arith_eval_items, arith_task
from grpolab.data.preferences import accuracy_pairs, refusal_pairs

PAIR_KINDS = {"accuracy": accuracy_pairs, "refusal": refusal_pairs}
FILE_NAMES = ("sft.jsonl", "prompts.jsonl", "heldout.jsonl", *(f"{kind}_pairs{suffix}.jsonl" for kind in PAIR_KINDS
                                                              for suffix in ("", "_heldout")))
"""The files export_builtin writes."""


def _write_jsonl(path: Path, rows) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return path


def _prompt_row(item) -> dict:
    return {"prompt": item.prompt, **item.meta}


def export_builtin(cfg, out: Path, *, prompts: int, pairs: int, heldout_pairs: int) -> dict[str, Path]:
    """Writes the files listed in the module docstring into `out` (created); returns {name: path}.

    prompts: GRPO training prompts (drawn with replacement, like the built-in stream); pairs /
    heldout_pairs: preference pairs per reward model, training / held-out side."""
    for name, n in (("--prompts", prompts), ("--pairs", pairs), ("--heldout-pairs", heldout_pairs)):
        if n < 1:
            raise ValueError(f"{name} must be at least 1, got {n}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    task, sc, seed = arith_task(cfg), cfg.sft, cfg.train.seed
    sft = task.sft_examples(random.Random(seed), sc.examples or BUILTIN_SFT_EXAMPLES,
                            refusal_examples=sc.refusal_examples, answer_noise=sc.answer_noise,
                            refusal_kinds=sc.refusal_kinds or None)
    files = {
        "sft": _write_jsonl(out / "sft.jsonl", ({"prompt": p, "response": c} for p, c in sft)),
        "prompts": _write_jsonl(out / "prompts.jsonl",
                                map(_prompt_row, task.train_prompts(random.Random(seed + 1), prompts))),
        "heldout": _write_jsonl(out / "heldout.jsonl", map(_prompt_row, arith_eval_items(cfg, task))),
    }
    for i, (kind, make) in enumerate(PAIR_KINDS.items()):
        for split, n, suffix in ((TRAIN, pairs, ""), (EVAL, heldout_pairs, "_heldout")):
            rng = random.Random(seed + 10 + 2 * i + (split == EVAL))
            drawn = [q for q in make(task, rng, 2 * n, split=split) if q.chosen and q.rejected][:n]
            rows = ({"prompt": q.prompt, "chosen": q.chosen, "rejected": q.rejected} for q in drawn)
            files[f"{kind}_pairs{suffix}"] = _write_jsonl(out / f"{kind}_pairs{suffix}.jsonl", rows)
    return files
