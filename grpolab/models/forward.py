"""Forward passes that give per-token log-probs of completions (Phase A's π_old/π_ref, Phase B's π)."""

from __future__ import annotations

import contextlib

import torch

from grpolab.algo.logprobs import entropy, token_logprobs
from grpolab.rollout.types import position_ids


def autocast(dtype: torch.dtype | None, device: str = "cpu"):
    """bf16 autocast when asked (master weights stay fp32), else a no-op context."""
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def completion_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    compute_dtype: torch.dtype | None = None,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the completion tokens (columns prompt_len..T-1) under `model`.

    input_ids, attention_mask: [n, T]. Returns (logp [n, Lc] float32, entropy [n, Lc] or None).
    Only the last Lc + 1 positions go through the LM head (`logits_to_keep`). The entropy is
    detached unless `entropy_grad` (an entropy bonus in the loss).
    """
    lc = input_ids.shape[1] - prompt_len
    with autocast(compute_dtype, str(input_ids.device)):
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask.long(),
            position_ids=position_ids(attention_mask),
            use_cache=False,
            logits_to_keep=lc + 1,
        )
    logits = out.logits[:, -(lc + 1) : -1]  # position t predicts token t+1
    labels = input_ids[:, prompt_len:]
    logp = token_logprobs(logits, labels, temperature)
    ent = entropy(logits if entropy_grad else logits.detach(), temperature) if with_entropy else None
    return logp, ent


@torch.no_grad()
def batched_logprobs(model, rollout, temperature: float, batch_size: int, compute_dtype=None) -> torch.Tensor:
    """No-grad log-probs of every completion token of a Rollout, in chunks of `batch_size` rows.

    Returns [N, Lc] float32 aligned with rollout.loss_mask (0 beyond each chunk's trimmed width).
    """
    n, lc = rollout.loss_mask.shape
    out = torch.zeros(n, lc, dtype=torch.float32, device=rollout.loss_mask.device)
    for s in range(0, n, batch_size):
        idx = torch.arange(s, min(n, s + batch_size))
        sub = rollout.select(idx)
        lp, _ = completion_logprobs(model, sub.input_ids, sub.attention_mask, sub.prompt_len, temperature,
                                    compute_dtype=compute_dtype)
        out[idx, : lp.shape[1]] = lp.float().to(out.device)
    return out
