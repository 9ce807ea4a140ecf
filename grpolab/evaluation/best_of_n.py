"""Best-of-N: N sampled completions per prompt, the one a scorer likes best kept; greedy vs best-of-N
by the model's own likelihood (the inference-time effect of sharpening, grpolab/sft/sharpen.py).

Winners are finished completions (ending in EOS): a truncated candidate wins only when all of its
prompt's candidates are truncated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from grpolab.algo.metrics import correct_rows, nanmean
from grpolab.rewards.base import combine, score_batch
from grpolab.rewards.registry import is_verifier
from grpolab.rewards.rules import is_correct, is_refusal
from grpolab.rollout.hf import decode_completions, generate_texts


def best_index(scores: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
    """Per prompt, the candidate with the highest score among the eligible ones.

    scores: [P, n] float (NaN = abstained: never picked while another candidate has a score);
    eligible: [P, n] bool (a row with no eligible scored candidate falls back to all of its
    scored ones, then to column 0). Ties go to the first candidate. Returns [P] int64.
    """
    assert scores.shape == eligible.shape and scores.dim() == 2, f"{tuple(scores.shape)} vs {tuple(eligible.shape)}"
    scored = ~torch.isnan(scores)
    ok = eligible & scored
    ok = torch.where(ok.any(-1, keepdim=True), ok, scored)
    return scores.masked_fill(~ok, -math.inf).argmax(-1)


@dataclass(frozen=True)
class BestOfN:
    """Best-of-N of P prompts with n candidates each."""

    texts: list[str]
    """[P] the winning completions."""
    scores: torch.Tensor
    """[P] float32: the winners' scores."""
    truncated: torch.Tensor
    """[P] bool: the winner hit max_new_tokens (only when all its prompt's candidates did)."""
    candidates: list[list[str]]
    """[P][n] every sampled completion."""
    candidate_scores: torch.Tensor
    """[P, n] float32 (NaN = the scorer abstained)."""
    candidate_truncated: torch.Tensor
    """[P, n] bool."""


@torch.no_grad()
def sample_candidates(model, engine, prompts: Sequence[str], n: int, generator: torch.Generator | None = None,
                      batch_prompts: int = 64) -> tuple[list[str], torch.Tensor]:
    """n sampled completions per prompt: (texts [P·n], prompt-major; truncated [P·n] bool)."""
    texts, trunc = [], []
    for s in range(0, len(prompts), batch_prompts):
        ro = engine.generate_with(model, list(prompts[s:s + batch_prompts]), n, generator=generator)
        texts += decode_completions(engine.tokenizer, ro)
        trunc.append(ro.truncated.cpu())
    return texts, torch.cat(trunc) if trunc else torch.zeros(0, dtype=torch.bool)


def best_of_n(model, engine, prompts: Sequence[str], n: int, scorer: Callable, generator: torch.Generator | None = None,
              metadata: Sequence[dict[str, Any]] | None = None, batch_prompts: int = 64) -> BestOfN:
    """Samples n completions per prompt from `model` and keeps, per prompt, the finished one with
    the highest `scorer` score. scorer: a reward function, (prompts, completions, metadata) -> one
    float (or None) per row, e.g. `rewards.self_likelihood.SelfLikelihood`; it gets each prompt's
    metadata plus `truncated`."""
    if n < 1:
        raise ValueError(f"best_of_n: n must be >= 1, got {n}")
    texts, trunc = sample_candidates(model, engine, prompts, n, generator, batch_prompts)
    metas = [{**(metadata[i // n] if metadata is not None else {}), "truncated": bool(t)} for i, t in enumerate(trunc)]
    scores = score_batch(scorer, [p for p in prompts for _ in range(n)], texts, metas).view(-1, n)  # [P, n]
    trunc = trunc.view(-1, n)
    idx = best_index(scores, ~trunc)
    rows = torch.arange(len(prompts))
    cands = [texts[i * n:(i + 1) * n] for i in range(len(prompts))]
    return BestOfN(texts=[cands[i][int(j)] for i, j in enumerate(idx)], scores=scores[rows, idx],
                   truncated=trunc[rows, idx], candidates=cands, candidate_scores=scores, candidate_truncated=trunc)


def arith_metrics(texts: Sequence[str], truncated: Sequence[bool], items) -> dict:
    """The built-in task's metrics of given completions (as `evaluate_arith` computes them for its
    own greedy ones): accuracy on answerable prompts, refusal recall, false refusals."""
    rows = list(zip(texts, truncated, items))
    ans = [(t, tr, it) for t, tr, it in rows if it.meta["answerable"]]
    una = [(t, tr, it) for t, tr, it in rows if not it.meta["answerable"]]
    return {
        "accuracy": sum(not tr and is_correct(t, it.meta) for t, tr, it in ans) / max(len(ans), 1),
        "refusal_recall": sum(not tr and is_refusal(t) for t, tr, _ in una) / max(len(una), 1),
        "false_refusal": sum(not tr and is_refusal(t) for t, tr, _ in ans) / max(len(ans), 1),
    }


def reward_metrics(rewards, items, texts: Sequence[str], truncated: Sequence[bool], reps: int = 1) -> dict:
    """Mean combined reward and `accuracy` (the first verifier's 1.0 rate, as `evaluate_task`) of
    `reps` consecutive completions per item; also `correct` [len(texts)] (NaN = abstained) when a
    verifier scored a row."""
    metas = [{**items[i // reps].meta, "truncated": bool(tr)} for i, tr in enumerate(truncated)]
    prompts = [it.prompt for it in items for _ in range(reps)]
    scores = {fn.name: score_batch(fn, prompts, texts, metas) for fn, _ in rewards}
    out: dict[str, Any] = {"reward": nanmean(combine(scores, {fn.name: w for fn, w in rewards}))}
    correct = correct_rows(scores, [fn.name for fn, _ in rewards if is_verifier(fn)])
    if correct is not None:
        out["accuracy"], out["correct"] = nanmean(correct), correct
    return out


def best_of_n_eval(model, engine, items, rewards, n: int, generator: torch.Generator | None = None,
                   scorer: Callable | None = None, length_normalized: bool = False, arith: bool = False) -> dict:
    """Held-out accuracy of greedy decoding vs best-of-n by self-likelihood (the inference-time
    effect of sharpening). rewards: [(RewardFn, weight)], the config's; scorer: default the
    self-likelihood under `model` itself (a frozen copy). arith: also the built-in task's metrics.

    Returns {"prompts", "n", "greedy", "best_of_n", "sampled"}: each with `reward`, `accuracy` (when a
    verifier scores) and `self_likelihood` (mean score of its completions); `sampled` (all n·P
    candidates: their accuracy is pass@1) has `pass@n` too; with arith each part has `arith`."""
    from grpolab.rewards.self_likelihood import SelfLikelihood

    if scorer is None:
        scorer = SelfLikelihood(model=model, tokenizer=engine.tokenizer, length_normalized=length_normalized)
    prompts, metas = [it.prompt for it in items], [it.meta for it in items]
    g_texts, g_trunc = generate_texts(model, engine, prompts, greedy=True)
    g_sl = score_batch(scorer, prompts, g_texts, [{**m, "truncated": t} for m, t in zip(metas, g_trunc)])
    best = best_of_n(model, engine, prompts, n, scorer, generator, metadata=metas)
    cand = [t for row in best.candidates for t in row]
    parts = {"greedy": (g_texts, g_trunc, 1, g_sl), "best_of_n": (best.texts, best.truncated.tolist(), 1, best.scores),
             "sampled": (cand, best.candidate_truncated.flatten().tolist(), n, best.candidate_scores.flatten())}
    out: dict[str, Any] = {"prompts": len(items), "n": n, "length_normalized": length_normalized}
    for name, (texts, trunc, reps, sl) in parts.items():
        res = reward_metrics(rewards, items, texts, trunc, reps)
        correct = res.pop("correct", None)
        res["self_likelihood"] = nanmean(sl)
        if name == "sampled" and correct is not None:  # prompts where the verifier scored a candidate
            hit, scored = (correct == 1.0).view(-1, n), ~torch.isnan(correct).view(-1, n).all(-1)
            res[f"pass@{n}"] = float(hit[scored].any(-1).float().mean()) if scored.any() else math.nan
        if arith:
            res["arith"] = arith_metrics(texts, trunc, [it for it in items for _ in range(reps)])
        out[name] = res
    return out
