"""Packing (prompt, completion) text pairs into the Rollout tensor layout (SFT, reward scoring)."""

from __future__ import annotations

from typing import Sequence

import torch

from grpolab.batch import Rollout


def pack_pairs(tokenizer, prompts: Sequence[str], completions: Sequence[str], add_eos: bool = True) -> Rollout:
    """Left-padded prompts + right-padded completions (each followed by EOS when add_eos).

    Returns a Rollout (group_size 1) whose loss_mask covers the completion tokens and the EOS.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"pack_pairs: {len(prompts)} prompts but {len(completions)} completions")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    p_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    c_ids = [tokenizer(c, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if add_eos else [])
             for c in completions]
    lp = max(len(x) for x in p_ids)
    lc = max(1, max(len(x) for x in c_ids))
    n = len(prompts)
    ids = torch.full((n, lp + lc), pad, dtype=torch.long)
    am = torch.zeros(n, lp + lc, dtype=torch.bool)
    for i, (p, c) in enumerate(zip(p_ids, c_ids)):
        ids[i, lp - len(p) : lp] = torch.tensor(p, dtype=torch.long)
        am[i, lp - len(p) : lp] = True
        if c:
            ids[i, lp : lp + len(c)] = torch.tensor(c, dtype=torch.long)
            am[i, lp : lp + len(c)] = True
    loss_mask = am[:, lp:].clone()
    return Rollout(input_ids=ids, attention_mask=am, prompt_len=lp, loss_mask=loss_mask,
                   truncated=torch.zeros(n, dtype=torch.bool), group_size=1)
