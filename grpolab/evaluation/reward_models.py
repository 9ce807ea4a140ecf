"""A reward model's pair accuracy on a policy's own samples: how the RM ranks what the policy actually
writes, not random held-out pairs (Gao et al. 2022 read over-optimization from it)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from grpolab.rewards.base import score_batch
from grpolab.algo.metrics import pair_accuracy


def policy_pair_accuracy(rms: dict[str, Any], labelers: dict[str, Any], policy, tokenizer, items: Sequence,
                         *, group_size: int = 8, max_new_tokens: int = 8, seed: int = 0) -> dict[str, float]:
    """{name: pair accuracy of rms[name] against labelers[name]} on `group_size` completions per
    prompt of `items` (PromptItems) sampled from `policy` at temperature 1: over every pair of
    completions of a prompt that the labeler (a reward function, higher = better, None = no
    judgement) tells apart, the share the RM ranks the same way (ties 1/2): by its raw scores
    (`.scores`, e.g. a reward_model reward, whatever its normalization or threshold), else its rewards.
    NaN for an RM when no pair was told apart."""
    from grpolab.rollout.hf import HFEngine, decode_completions

    engine = HFEngine(tokenizer, max_new_tokens)
    ro = engine.generate_with(policy, [it.prompt for it in items], group_size,
                              generator=torch.Generator().manual_seed(seed))
    texts = decode_completions(tokenizer, ro)
    prompts = [it.prompt for it in items for _ in range(group_size)]
    trunc = ro.truncated.tolist()
    metas = [{**items[i // group_size].meta, "truncated": trunc[i]} for i in range(len(texts))]
    out = {}
    for name, rm in rms.items():
        gold = score_batch(labelers[name], prompts, texts, metas)
        scores = rm.scores(prompts, texts) if hasattr(rm, "scores") else score_batch(rm, prompts, texts, metas)
        out[name] = pair_accuracy(scores, gold, group_size)
    return out
