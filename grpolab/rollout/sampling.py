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
    filtered = filter_logits(z, top_k, top_p)
    # filter_logits returns z itself when it filters nothing: then the probabilities are exp(logp_all)
    probs = logp_all.exp() if filtered is z else torch.softmax(filtered, dim=-1)
    tokens = draw_categorical(probs, generator)
    return tokens, logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def draw_categorical(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index per row, drawn with probability probs[b, i] / probs[b].sum() (inverse CDF).

    probs: [B, V], non-negative, each row with a positive finite sum. Returns: [B] int64.
    One uniform per row against the row's float64 cumulative sum: a zero-probability index is
    never drawn (its CDF step is empty). `torch.multinomial(probs, 1)` draws V exponentials per
    row instead (a random number and a logarithm per vocabulary entry at every decode step), which
    on a CPU dominates the sampling with vocabularies of tens of thousands of tokens. Raises
    ValueError for a row with a NaN, infinite or zero total (the logits were not finite).
    """
    cdf = probs.cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1:]
    if not bool((torch.isfinite(total) & (total > 0)).all()):
        raise ValueError("sampling: a row of next-token probabilities is NaN, infinite or all zero "
                         "(the model's logits are not finite)")
    u = torch.rand(total.shape, dtype=torch.float64, device=probs.device, generator=generator) * total
    # first index whose CDF exceeds u; u < total, so it exists (the clamp only guards rounding)
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


def greedy_tokens(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """argmax tokens [B] and their log-prob [B] (temperature 1)."""
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    tokens = logp_all.argmax(-1)
    return tokens, logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
