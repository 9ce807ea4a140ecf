"""Sharpening (Huang et al. 2024, "Self-improvement in language models: the sharpening mechanism").

A model's own likelihood as a verifier-free reward, used three ways:

- inference: `evaluation.best_of_n.best_of_n` samples N completions per prompt and keeps the one
  with the highest score (`rewards.self_likelihood`: log π0(y|x)); `best_of_n_eval` there compares
  the held-out accuracy of greedy decoding with best-of-N by the model's own likelihood;
- SFT-sharpening: `sharpen_sft` runs best-of-N under a frozen π0 on training prompts, then SFT
  (`sft.sft.train_sft`) on the (prompt, winner) pairs (`grpolab sharpen`);
- RL-sharpening needs no code here: GRPO with the self_likelihood reward
  (examples/rl_sharpening.yaml).

Winners are finished completions (ending in EOS): a truncated candidate wins only when all of its
prompt's candidates are truncated, and such winners are left out of SFT (SFT appends EOS).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from grpolab.evaluation.best_of_n import BestOfN, best_of_n
from grpolab.sft.sft import train_sft


@dataclass(frozen=True)
class SharpenResult:
    best: BestOfN
    """Best-of-N under π0 on the training prompts (the SFT targets)."""
    pairs: list[tuple[str, str]]
    """(prompt, winner) pairs SFT trained on: the finished winners."""
    losses: list[float]
    """SFT loss per optimizer step."""


def sharpen_sft(model, engine, prompts: Sequence[str], n: int, scorer: Callable, *, steps: int, batch_size: int,
                microbatch_size: int, lr: float, seed: int = 0, generator: torch.Generator | None = None,
                on_step: Callable[[int, float], None] | None = None, batch_prompts: int = 64) -> SharpenResult:
    """SFT-sharpening: best-of-N of `model` (π0) by `scorer` (self-likelihood under a frozen π0, which
    must not share `model`'s weights) on `prompts`, then SFT of `model` in place on the winners."""
    best = best_of_n(model, engine, prompts, n, scorer, generator, batch_prompts=batch_prompts)
    pairs = [(p, t) for p, t, tr in zip(prompts, best.texts, best.truncated.tolist()) if not tr]
    if not pairs:
        raise ValueError(f"sharpen: all {len(prompts)} best-of-{n} winners hit rollout.max_new_tokens="
                         f"{engine.max_new_tokens} without EOS; raise it")
    losses = train_sft(model, engine.tokenizer, pairs, steps=steps, batch_size=batch_size,
                       microbatch_size=microbatch_size, lr=lr, seed=seed, on_step=on_step)
    return SharpenResult(best=best, pairs=pairs, losses=losses)


