"""Held-out evaluation: greedy (or sampled) completions scored with the exact rule checks."""

from __future__ import annotations

from typing import Sequence

import torch

from grpolab.rewards.rules import is_correct, is_refusal
from grpolab.rollout.hf import HFEngine, decode_completions


@torch.no_grad()
def generate_texts(model, engine: HFEngine, prompts: Sequence[str], batch_size: int = 256,
                   greedy: bool = True, generator=None) -> tuple[list[str], list[bool]]:
    """One completion per prompt: (texts, truncated flags)."""
    texts, trunc = [], []
    for s in range(0, len(prompts), batch_size):
        ro = engine.generate_with(model, prompts[s : s + batch_size], 1, generator=generator, greedy=greedy)
        texts += decode_completions(engine.tokenizer, ro)
        trunc += ro.truncated.tolist()
    return texts, trunc


def evaluate_arith(model, engine: HFEngine, items, greedy: bool = True, generator=None) -> dict:
    """accuracy: share of answerable prompts answered correctly; refusal_recall: share of
    unanswerable prompts refused; false_refusal: share of answerable prompts refused.
    A completion that did not end with EOS counts as wrong (and as no refusal)."""
    texts, trunc = generate_texts(model, engine, [it.prompt for it in items], greedy=greedy, generator=generator)
    ans = [(t, tr, it) for t, tr, it in zip(texts, trunc, items) if it.meta["answerable"]]
    una = [(t, tr, it) for t, tr, it in zip(texts, trunc, items) if not it.meta["answerable"]]
    acc = sum(1 for t, tr, it in ans if not tr and is_correct(t, it.meta)) / max(len(ans), 1)
    rec = sum(1 for t, tr, it in una if not tr and is_refusal(t)) / max(len(una), 1)
    fr = sum(1 for t, tr, it in ans if not tr and is_refusal(t)) / max(len(ans), 1)
    by_op: dict[str, list[int]] = {}
    for t, tr, it in ans:
        by_op.setdefault(it.meta["op"], []).append(int(not tr and is_correct(t, it.meta)))
    by_kind: dict[str, list[int]] = {}
    for t, tr, it in una:
        by_kind.setdefault(it.meta["kind"], []).append(int(not tr and is_refusal(t)))
    return {
        "accuracy": acc, "refusal_recall": rec, "false_refusal": fr,
        "refusal_recall_by_kind": {k: sum(v) / len(v) for k, v in sorted(by_kind.items())},
        "answerable": len(ans), "unanswerable": len(una),
        "accuracy_by_op": {op: sum(v) / len(v) for op, v in sorted(by_op.items())},
        "examples": [{"prompt": it.prompt, "completion": t} for t, _, it in list(zip(texts, trunc, items))[:12]],
    }
