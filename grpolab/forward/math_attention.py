"""Attention of short sequences as plain tensor ops: two bf16 matmuls around a float32 softmax.

PyTorch's CPU flash-attention kernels pay a fixed cost per (row, head), which outweighs the
attention's own work on rows a few dozen tokens long, so short rows are faster as two matmuls:
`attention.grpolab_attention` sends bf16 attention of short rows here, with or without grad.
"""

from __future__ import annotations

import torch

_MASKED = torch.finfo(torch.float32).min


def short_attention(query, key, value, attention_mask=None, scaling=None, every_query_sees_a_key=False):
    """Attention of short sequences as two bf16 matmuls around a float32 softmax.

    query: [B, H, Lq, D]; key, value: [B, Hkv, Lk, D] (H a multiple of Hkv: query head j reads
    key/value head j // (H / Hkv)); attention_mask: bool broadcastable to [B, H, Lq, Lk] (True =
    attend), or None for causal attention (Lq == Lk). scaling: None means D ** -0.5. Returns
    [B, Lq, H, D] bf16, as transformers' SDPA attention; a query that may attend to nothing gets 0,
    as from SDPA (not NaN). every_query_sees_a_key: the caller's promise that no query is fully
    masked (true of causal masks over right-padded rows), which saves that zeroing pass.

    The scores are rounded to bf16 before the softmax, an error of the size of the bf16 rounding
    of the query and key themselves (tests/forward/test_forward.py compares with float32 SDPA). The
    mask enters as an additive float32 bias, fused with the scaling into one add: a `masked_fill`
    would be one more pass over the [B, H, Lq, Lk] scores forward and another backward, on rows this
    short a cost of the order of the matmuls themselves.
    """
    b, h, lq, d = query.shape
    hkv, lk = key.shape[1], key.shape[2]
    if attention_mask is None:
        attention_mask, every_query_sees_a_key = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril(), True
    with torch.autocast(query.device.type, enabled=False):
        bias = torch.where(attention_mask, 0.0, _MASKED)  # float32, the mask's (small, broadcast) shape
        # the query heads that share a key/value head are stacked along the rows: one matmul per group
        q = query.to(torch.bfloat16).reshape(b, hkv, h // hkv * lq, d)
        scores = torch.matmul(q, key.to(torch.bfloat16).transpose(-1, -2)).reshape(b, h, lq, lk)
        probs = torch.add(bias, scores, alpha=d**-0.5 if scaling is None else scaling).softmax(-1)
        if not every_query_sees_a_key:  # a fully masked query's softmax is uniform: zero it, as SDPA does
            probs = probs * attention_mask.any(-1, keepdim=True)
        probs = probs.to(torch.bfloat16).reshape(b, hkv, h // hkv * lq, lk)
        out = torch.matmul(probs, value.to(torch.bfloat16)).reshape(b, h, lq, d)
    return out.transpose(1, 2).contiguous()
