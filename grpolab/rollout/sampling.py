"""Token sampling from logits: temperature, top-k, top-p. Pure tensor functions."""

from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Masks logits outside the top-k / nucleus (top-p) set with -inf.

    logits: [B, V] (already divided by the temperature). Returns: [B, V]; the most likely token is
    always kept.
    """
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples one token per row.

    logits: [B, V]. Returns (tokens [B] int64, logp [B] float32 = log-prob of the token under the
    temperature-scaled, unfiltered distribution — the one the training loss uses).
    """
    z = logits.float() / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    probs = torch.softmax(filter_logits(z, top_k, top_p), dim=-1)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def greedy_tokens(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """argmax tokens [B] and their log-prob [B] (temperature 1)."""
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    tokens = logp_all.argmax(-1)
    return tokens, logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
