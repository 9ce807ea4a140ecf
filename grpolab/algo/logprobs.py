"""Per-token log-probabilities and entropy from logits, without a full log-softmax copy.

log p(y) = z_y / T - logsumexp(z / T). Rows are processed in chunks (upcast to float32 one chunk
at a time), so peak extra memory is one chunk × vocab instead of a float32 copy of all logits.
"""

from __future__ import annotations

import torch

_CHUNK_ROWS = 2048


def token_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, chunk_rows: int = _CHUNK_ROWS
) -> torch.Tensor:
    """Log-prob of each label under softmax(logits / temperature).

    logits: [..., V] (any float dtype); labels: [...] int64 with the same leading shape.
    Returns: [...] float32. Differentiable with respect to logits.
    """
    assert logits.shape[:-1] == labels.shape, f"logits {tuple(logits.shape)} vs labels {tuple(labels.shape)}"
    flat = logits.reshape(-1, logits.shape[-1])
    lab = labels.reshape(-1)
    out = []
    for s in range(0, flat.shape[0], chunk_rows):
        z = flat[s : s + chunk_rows].float()
        if temperature != 1.0:
            z = z / temperature
        picked = z.gather(-1, lab[s : s + chunk_rows].unsqueeze(-1)).squeeze(-1)
        out.append(picked - torch.logsumexp(z, dim=-1))
    if not out:
        return flat.new_zeros(labels.shape, dtype=torch.float32)
    return torch.cat(out).reshape(labels.shape)


def entropy(logits: torch.Tensor, temperature: float = 1.0, chunk_rows: int = _CHUNK_ROWS) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position.

    logits: [..., V]. Returns: [...] float32 (nats).
    """
    flat = logits.reshape(-1, logits.shape[-1])
    out = []
    for s in range(0, flat.shape[0], chunk_rows):
        z = flat[s : s + chunk_rows].float()
        if temperature != 1.0:
            z = z / temperature
        lse = torch.logsumexp(z, dim=-1)
        p = torch.softmax(z, dim=-1)
        out.append(lse - (p * z).sum(-1))
    if not out:
        return flat.new_zeros(logits.shape[:-1], dtype=torch.float32)
    return torch.cat(out).reshape(logits.shape[:-1])


def sequence_logprob(token_logp: torch.Tensor, loss_mask: torch.Tensor, mean: bool = False) -> torch.Tensor:
    """Sum (or mean) of the counted token log-probs of each sequence.

    token_logp: [N, L]; loss_mask: [N, L] bool (True = counts). Returns: [N].
    Used by the sharpening self-reward (the model's own sequence log-likelihood).
    """
    m = loss_mask.to(token_logp.dtype)
    total = (token_logp * m).sum(-1)
    return total / m.sum(-1).clamp(min=1) if mean else total
