"""Attention of a padding-free batch's short rows, computed right-padded.

The padding-free forwards (`plans.PackedRows`) put a batch's real
tokens into one row, so its linear layers compute no padding; attention must then stay within each
original row. `row_attention.per_row_attention` runs PyTorch's flash kernel once per row, which
costs a fixed amount per (row, head): on rows of a few dozen tokens, more than the attention's
own work. For short rows the attention instead gathers the rows' queries, keys
and values into a right-padded batch [n, H, L, D] (`to_padded`; L = the longest row), runs
`math_attention.short_attention` there, and gathers the outputs back to the packed tokens (`from_padded`).
The gathers copy only the attention's inputs and outputs; the linear layers keep their padding-free
savings.

The index maps (`padded_maps`) are built on the host once per forward and reach the traced code
as tensors, so torch.compile keeps one graph whatever the rows are. The two layout changes are
traced forward (inductor fuses the gathers with their neighbours) and have custom operators as
backward (an index add, an index copy): traced as index ops, inductor would fuse such a backward
with its neighbours' into slow kernels dominated by index arithmetic.

The packed row itself is padded to few sizes (`padded_count`, with `dummy_rows`): in bf16 on a
CPU, oneDNN builds a kernel for every matrix size it meets and keeps it.
"""

from __future__ import annotations

import torch
from torch import Tensor


def padded_maps(lengths: Tensor, expand: Tensor | None = None,
                collapse: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The index maps of the padded attention for packed rows of `lengths` (int64 [n], all > 0).

    Returns (gather [n, L] int64: the packed token that slot j of row i reads (token 0 for a
    padding slot, which no real query attends to); scatter [T] int64: for each packed token, the
    flattened slot i·L + j its output comes from; visible [n, 1, L, L] bool: causal over the row's
    real slots). With (expand [R], collapse [K]) of `shared_prompt.packed_group_layout`, the rows
    are the original rows (R tokens, each prompt in each of its rows) over the K distinct tokens:
    the gather reads through `expand`, and each distinct token's output comes from the slot of the
    place `collapse` names.
    """
    n, width = lengths.numel(), int(lengths.max())
    slot = torch.arange(width, device=lengths.device)
    real = slot[None, :] < lengths[:, None]  # [n, L]
    token = ((lengths.cumsum(0) - lengths)[:, None] + slot[None, :]) * real  # row-major place among the R tokens
    scatter = (torch.arange(n, device=lengths.device)[:, None] * width + slot[None, :])[real]  # [R]
    causal = torch.ones(width, width, dtype=torch.bool, device=lengths.device).tril()
    visible = causal[None, None] & real[:, None, None, :]
    if expand is None:
        return token, scatter, visible
    return expand[token], scatter[collapse], visible


@torch.library.custom_op("grpolab::to_padded_backward", mutates_args=(), device_types="cpu")
def to_padded_backward(grad: Tensor, gather: Tensor, num_tokens: int) -> Tensor:
    """[n, H, L, D] slot gradients -> [1, H, T, D] (strides of a [T, H, D] tensor), summed over the
    slots that read a token."""
    n, h, width, d = grad.shape
    slots = grad.transpose(1, 2).reshape(n * width, h, d)
    return slots.new_zeros(num_tokens, h, d).index_add_(0, gather.flatten(), slots).transpose(0, 1)[None]


@to_padded_backward.register_fake
def _(grad, gather, num_tokens):
    return grad.new_empty(num_tokens, grad.shape[1], grad.shape[3]).transpose(0, 1)[None]


class _ToPadded(torch.autograd.Function):
    """Traced forward (inductor fuses the gather with its neighbours), an operator as backward."""

    @staticmethod
    def forward(x: Tensor, gather: Tensor) -> Tensor:
        n, width = gather.shape
        tokens = x[0].transpose(0, 1)  # [T, H, D]
        return tokens.index_select(0, gather.flatten()).view(n, width, *tokens.shape[1:]).transpose(1, 2).contiguous()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])
        ctx.num_tokens = inputs[0].shape[2]

    @staticmethod
    def backward(ctx, grad):
        (gather,) = ctx.saved_tensors
        return to_padded_backward(grad.contiguous(), gather, ctx.num_tokens), None


def to_padded(x: Tensor, gather: Tensor) -> Tensor:
    """[1, H, T, D] packed tokens -> [n, H, L, D] contiguous: slot (i, j) holds token gather[i, j]."""
    return _ToPadded.apply(x, gather)


@torch.library.custom_op("grpolab::from_padded_backward", mutates_args=(), device_types="cpu")
def from_padded_backward(grad: Tensor, scatter: Tensor, num_rows: int, width: int) -> Tensor:
    """[1, K, H, D] token gradients -> [n, L, H, D] slot gradients (0 where no token reads the slot)."""
    h, d = grad.shape[2], grad.shape[3]
    slots = grad.new_zeros(num_rows * width, h, d).index_copy_(0, scatter, grad[0])
    return slots.view(num_rows, width, h, d)


@from_padded_backward.register_fake
def _(grad, scatter, num_rows, width):
    return grad.new_empty(num_rows, width, grad.shape[2], grad.shape[3])


class _FromPadded(torch.autograd.Function):
    """Traced forward, an operator as backward (see `_ToPadded`)."""

    @staticmethod
    def forward(out: Tensor, scatter: Tensor) -> Tensor:
        n, width, h, d = out.shape
        return out.reshape(n * width, h, d).index_select(0, scatter)[None]

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])
        ctx.num_rows, ctx.width = inputs[0].shape[0], inputs[0].shape[1]

    @staticmethod
    def backward(ctx, grad):
        (scatter,) = ctx.saved_tensors
        return from_padded_backward(grad.contiguous(), scatter, ctx.num_rows, ctx.width), None


def from_padded(out: Tensor, scatter: Tensor) -> Tensor:
    """[n, L, H, D] slot outputs -> [1, K, H, D] contiguous: packed token k gets slot scatter[k]."""
    return _FromPadded.apply(out, scatter)


_DUMMY_ROW_TOKENS = 64
"""The longest dummy row `forward._packed_forward` appends (they stay short rows for the padded attention)."""


def padded_count(n: int) -> int:
    """`n` rounded up to one of 16 sizes per power of two: at most 1/16 more, or up to 7 more below
    128 (sizes are multiples of 8); 0 stays 0."""
    step = _padded_step(n)
    return -(-n // step) * step


def _padded_step(n: int) -> int:
    """The multiple `padded_count` rounds `n` up to."""
    return max(8, 1 << max(n.bit_length() - 5, 0))


def dummy_rows(tokens: int, predictors: int, longest: int) -> list[int]:
    """The lengths of the dummy rows (token 0, rows of their own) `forward._packed_forward` appends
    to a packed row of `tokens` real tokens so that their count is a `padded_count` size above
    `padded_count(predictors)`.

    None is longer than the `longest` real row, unless that is under 16 tokens, nor than 64 (a
    longer one would widen every row of the padded attention: more work and a new set of oneDNN
    kernels), and their number depends only on the padding step and `longest`, not on how many
    tokens are missing, unless the predictors force more: the padded attention then sees a few row
    counts, not one per microbatch."""
    width = max(16, min(_DUMMY_ROW_TOKENS, longest))
    count = -(-2 * _padded_step(tokens) // (width - 1))  # enough for any shortfall below two steps
    # more tokens than predictors after padding too: torch.compile's duck sizing would otherwise tie
    # the two sizes together in its guards when they first happen to be equal, and recompile later
    extra = padded_count(max(tokens + count, padded_count(predictors) + 1)) - tokens
    count = max(count, -(-extra // width))
    return [extra // count + (i < extra % count) for i in range(count)]
