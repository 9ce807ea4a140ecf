"""Causal attention within each row of a padding-free batch, as one operator torch.compile can keep in its graph.

The padding-free forward (`plans.PackedRows`) runs one SDPA call per original row. Written as a
Python loop, torch.compile would unroll it for the rows of the batch it traced (a recompilation for
each new set of rows) or break its graph around it. `per_row_attention` is a custom operator
instead: the row lengths are a tensor argument, the loop runs inside the operator, and the
compiled graph stays one graph whatever the rows are.

CPU only (PyTorch's CPU flash-attention kernels, whose forward also returns the log-sum-exp
the backward needs), no dropout; `plans.per_row_sdpa` loops in Python for anything else.
"""

from typing import Optional

import torch
from torch import Tensor


@torch.library.custom_op("grpolab::per_row_attention", mutates_args=(), device_types="cpu")
def per_row_attention(query: Tensor, key: Tensor, value: Tensor, rows: Tensor,
                      scale: Optional[float] = None) -> tuple[Tensor, Tensor]:
    """Causal attention of each row of a packed batch with itself.

    query: [1, H, R, D]; key, value: [1, Hkv, R, D] (H a multiple of Hkv); rows: int64 [n], the row
    lengths (summing to R). Returns (out [1, R, H, D] contiguous, the layout transformers' attention
    functions return; lse [1, H, R] float32, each query's log-sum-exp, for the backward).
    """
    lengths = rows.tolist()
    outs, lses = [], []
    for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2)):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        outs.append(out.transpose(1, 2))
        lses.append(lse)
    return torch.cat(outs, 1).contiguous(), torch.cat(lses, 2).contiguous()  # the fake's (contiguous) strides


@per_row_attention.register_fake
def _(query, key, value, rows, scale=None):
    b, h, r, d = query.shape
    return query.new_empty(b, r, h, d), query.new_empty(b, h, r, dtype=torch.float32)


@torch.library.custom_op("grpolab::per_row_attention_backward", mutates_args=(), device_types="cpu")
def per_row_attention_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor,
                               lse: Tensor, rows: Tensor, scale: Optional[float] = None
                               ) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (query, key, value; their shapes) of `per_row_attention` given grad_out [1, R, H, D]."""
    lengths = rows.tolist()
    grads = [[], [], []]
    parts = zip(grad_out.split(lengths, 1), query.split(lengths, 2), key.split(lengths, 2),
                value.split(lengths, 2), out.split(lengths, 1), lse.split(lengths, 2))
    for go, q, k, v, o, m in parts:
        for acc, g in zip(grads, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                go.transpose(1, 2), q, k, v, o.transpose(1, 2), m, 0.0, True, scale=scale)):
            acc.append(g)
    return tuple(torch.cat(g, 2).contiguous() for g in grads)  # the fake's (contiguous) strides


@per_row_attention_backward.register_fake
def _(grad_out, query, key, value, out, lse, rows, scale=None):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _setup_context(ctx, inputs, output):
    query, key, value, rows, scale = inputs
    ctx.save_for_backward(query, key, value, rows, *output)
    ctx.scale = scale


def _backward(ctx, grad_out, _grad_lse):
    query, key, value, rows, out, lse = ctx.saved_tensors
    return (*per_row_attention_backward(grad_out.contiguous(), query, key, value, out, lse, rows, ctx.scale),
            None, None)


per_row_attention.register_autograd(_backward, setup_context=_setup_context)
