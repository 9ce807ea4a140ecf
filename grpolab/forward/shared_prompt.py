"""One forward of each group's prompt in the log-prob passes (model.shared_prompt).

The G rows of a GRPO group share their prompt. The ordinary padded forward computes that prompt
G times; here each group goes through the model as one row

    [prompt (Lp columns, left-padded) | completion 1 (Lc) | completion 2 (Lc) | ... | completion G (Lc)]

so the model's linear layers see Lp + G·Lc positions per group instead of G·(Lp + Lc). Positions
restart after the prompt for every completion, and attention (`split_attention`) is computed in the
ordinary row layout: the prompt attends to itself (causal, real tokens only) and completion g to
the prompt's real tokens and to itself (causal). Every real token therefore sees what it sees in
the padded forward; the log-probs agree up to the rounding of differently shaped products
(tests/forward/test_shared_prompt.py).

The layout is built by `group_layout`; its attention plan (`forward.plans.GroupedRows`) goes to
the model's attention with the call. Batches of rows are cut in whole groups (`forward.buckets`).

With model.padding_free as well (`packed_group_layout`, `forward.plans.PackedRows`), the batch goes through
the model as one row of its K distinct real tokens (each group's prompt once, then its completions'
real tokens): the linear layers compute neither padding nor prompt copies. Attention gathers each
original row back (its prompt copied in, by index): right-padded for short rows in bf16 on a CPU
(`padded_attention`), else for the padding-free per-row attention; the outputs are gathered back
to the K tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from grpolab.forward.buckets import group_rows
from grpolab.batch import position_ids

@dataclass(frozen=True)
class GroupLayout:
    """The grouped forward's inputs for n = U·G rows of width Lp + Lc (`group_layout`)."""

    input_ids: torch.Tensor
    """[U, Lp + G·Lc] int64: each group's prompt, then its G completions (each Lc wide, padding kept)."""
    position_ids: torch.Tensor
    """[U, Lp + G·Lc] int64: the rows' own positions (prompt from 0 at its first real token; each
    completion continues from the prompt's length)."""
    prompt_attend: torch.Tensor
    """[U, 1, Lp, Lp] bool: causal over the prompt's real tokens (a padding query attends to itself
    only, so no query row is empty)."""
    completion_attend: torch.Tensor
    """[U·G, 1, Lc, Lp + Lc] bool: the prompt's real tokens, then causal within the completion."""
    predictors: torch.Tensor
    """[1 + G·(Lc - 1)] int64: the columns whose logits score completion tokens: the prompt's last
    column (every completion's first token), then column Lp + g·Lc + t for token t + 1 of completion g."""


def group_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, group_size: int) -> GroupLayout:
    """The grouped layout of rows g·G .. g·G + G - 1 (one group each, in order).

    input_ids, attention_mask: [n, Lp + Lc] with a left-padded prompt in the first `prompt_len`
    columns and right-padded completions after it, as rollouts are. ValueError when n is not a
    multiple of group_size, when the rows of a group do not share their prompt (ids and mask), or
    when a prompt's last column is padding (it predicts every completion's first token).
    """
    group_layout_check(input_ids, attention_mask, prompt_len, group_size)
    n, width = input_ids.shape
    g, lp, lc = group_size, prompt_len, width - prompt_len
    u = n // g
    p_ids, key_real = input_ids[:, :lp].view(u, g, lp), attention_mask[::g, :lp].bool()  # key_real: [U, Lp]
    device = input_ids.device
    ids = torch.cat([p_ids[:, 0], input_ids[:, lp:].reshape(u, g * lc)], 1)
    prompt_pos = position_ids(key_real)
    completion_pos = (key_real.sum(-1, keepdim=True) + torch.arange(lc, device=device)).repeat(1, g)
    eye = torch.eye(lp, dtype=torch.bool, device=device)
    prompt_attend = (torch.ones(lp, lp, dtype=torch.bool, device=device).tril() & key_real[:, None, :]) | eye
    causal = torch.ones(lc, lc, dtype=torch.bool, device=device).tril()
    completion_attend = torch.cat([key_real[:, None, :].expand(u, lc, lp), causal.expand(u, lc, lc)], -1)
    # contiguous: a view's strides (a single group's mask is one) would be guarded on by torch.compile
    completion_attend = completion_attend[:, None].expand(u, g, lc, lp + lc).reshape(n, 1, lc, lp + lc).contiguous()
    starts = lp + torch.arange(g, device=device)[:, None] * lc
    predictors = torch.cat([torch.tensor([lp - 1], device=device),
                            (starts + torch.arange(lc - 1, device=device)).flatten()])
    return GroupLayout(ids, torch.cat([prompt_pos, completion_pos], 1), prompt_attend[:, None],
                       completion_attend, predictors)


def group_layout_check(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, group_size: int) -> None:
    """ValueError unless the n rows are whole groups of `group_size` rows that share their prompt
    (ids and mask) and each prompt's last column is a real token."""
    n, width = input_ids.shape
    g, lp, lc = group_size, prompt_len, width - prompt_len
    if g < 1 or n % g:
        raise ValueError(f"model.shared_prompt: {n} rows are not whole groups of rollout.group_size={g}")
    if lp < 1 or lc < 1:
        raise ValueError(f"model.shared_prompt: needs prompt and completion columns (prompt_len={lp}, width={width})")
    u = n // g
    p_ids, p_real = input_ids[:, :lp].view(u, g, lp), attention_mask[:, :lp].bool().view(u, g, lp)
    same = (p_real == p_real[:, :1]).all() & ((p_ids == p_ids[:, :1]) | ~p_real).all()
    if not bool(same):
        raise ValueError(f"model.shared_prompt: rows g·{g} .. g·{g}+{g - 1} must share one prompt (ids and "
                         "attention_mask); order rows by group and cut batches in whole groups")
    if not bool(p_real[:, 0, -1].all()):
        raise ValueError("model.shared_prompt: a prompt's last column is padding (prompts must be left-padded)")


@dataclass(frozen=True)
class PackedGroupLayout:
    """The padding-free grouped forward's inputs (`packed_group_layout`): the K distinct real tokens of
    a batch, each group's prompt once, then its completions' real tokens, as one row."""

    input_ids: torch.Tensor
    """[1, K] int64: per group, its prompt's real tokens, then each completion's real tokens."""
    position_ids: torch.Tensor
    """[1, K] int64: each token's position in its original row."""
    expand: torch.Tensor
    """[R] int64: for each real token of the original rows (row-major, R of them), its place in the
    K tokens: attention runs on the original rows, each prompt copied into each of its rows."""
    collapse: torch.Tensor
    """[K] int64: for each of the K tokens, one of its places among the R (a prompt: its group's first row)."""
    row_lengths: torch.Tensor
    """[rows with real tokens] int64: the original rows' real lengths (they sum to R)."""
    predictors: torch.Tensor
    """[S] int64: for each scored completion token (real, row-major), the place among the K of the
    token before it in its row."""
    scored: torch.Tensor
    """[n, Lc] bool: the completion tokens that get a log-prob (the real ones)."""


def packed_group_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                        group_size: int) -> PackedGroupLayout:
    """`group_layout` without padding: the rows' real tokens, each group's prompt once.

    Same input contract as `group_layout` (rows g·G .. g·G + G - 1 share their prompt; left-padded
    prompts, right-padded completions, checked by the caller for gaps); ValueError otherwise.
    """
    group_layout_check(input_ids, attention_mask, prompt_len, group_size)
    real = attention_mask.bool()
    n, width = real.shape
    lp, g = prompt_len, group_size
    first_of_group = (torch.arange(n, device=real.device) % g == 0)[:, None]
    is_prompt = (torch.arange(width, device=real.device) < lp)[None, :]
    distinct = real & (~is_prompt | first_of_group)  # [n, W]: the K tokens, in row-major order
    k = int(distinct.sum())
    place = torch.full((n, width), -1, dtype=torch.long, device=real.device)
    place[distinct] = torch.arange(k, device=real.device)
    place[:, :lp] = place[::g, :lp].repeat_interleave(g, 0)  # every row's prompt is its group's first row's
    where = torch.full((n, width), -1, dtype=torch.long, device=real.device)
    where[real] = torch.arange(int(real.sum()), device=real.device)
    scored = real[:, lp:]
    lengths = real.sum(-1)
    positions = position_ids(real)
    return PackedGroupLayout(input_ids[distinct][None], positions[distinct][None], place[real], where[distinct],
                             lengths[lengths > 0], place[:, lp - 1 : width - 1][scored], scored)


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def split_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prompt_attend: torch.Tensor,
                    completion_attend: torch.Tensor, g: int, attend: Attend) -> torch.Tensor:
    """Attention of grouped rows (`group_layout`), computed in the ordinary row layout.

    query: [U, H, Lp + G·Lc, D]; key, value: [U, Hkv, Lp + G·Lc, D]; prompt_attend [U, 1, Lp, Lp]
    and completion_attend [U·G, 1, Lc, Lp + Lc] the layout's masks; g = G. `attend(q, k, v, mask)` is
    the model's attention on ordinary rows (q [B, H, Lq, D], k/v [B, Hkv, Lk, D], bool mask
    [B, 1, Lq, Lk]) returning [B, Lq, H, D]. It runs twice: the prompts against themselves, and
    the U·G completions against [their prompt's keys | their own keys]. Returns [U, Lp + G·Lc, H, D].
    """
    # G is a Python int and Lc the mask's own size: derived from U·G // U (sizes torch.compile
    # traces symbolically), inductor would index the backward's copy of the completions' output
    # gradient by floor divisions and modulos of those symbols, element by element (slow).
    u, h, _, d = query.shape
    lp, lc = prompt_attend.shape[-1], completion_attend.shape[2]
    assert query.shape[2] == lp + g * lc, f"grouped rows of {query.shape[2]} columns vs masks for {lp} + {g}·{lc}"

    rows_q = to_rows(query, lp, g, False)  # [U·G, H, Lc, D]
    rows_k, rows_v = to_rows(key, lp, g, True), to_rows(value, lp, g, True)  # [U·G, Hkv, Lp + Lc, D]
    out_prompt = attend(query[:, :, :lp], key[:, :, :lp], value[:, :, :lp], prompt_attend)  # [U, Lp, H, D]
    out_rows = attend(rows_q, rows_k, rows_v, completion_attend)  # [U·G, Lc, H, D]
    return torch.cat([out_prompt, out_rows.reshape(u, g * lc, h, d)], 1)


def to_rows(x: torch.Tensor, prompt_len: int, group_size: int, with_prompt: bool) -> torch.Tensor:
    """Grouped columns [U, H, Lp + G·Lc, D] -> rows [U·G, H, Lc, D] (completion g of group u is row
    u·G + g); with_prompt: each row starts with its group's Lp prompt columns ([U·G, H, Lp + Lc, D])."""
    u, h, width, d = x.shape
    lp, g = prompt_len, group_size
    lc = (width - lp) // g
    rows = x[:, :, lp:].reshape(u, h, g, lc, d).transpose(1, 2).reshape(u * g, h, lc, d)
    if not with_prompt:
        return rows
    prompt = x[:, None, :, :lp].expand(u, g, h, lp, d).reshape(u * g, h, lp, d)
    return torch.cat([prompt, rows], 2)


def group_permutation(num_rows: int, group_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """A random order of whole groups: [num_rows] int64, each group's rows together and in order."""
    return group_rows(torch.randperm(num_rows // group_size, generator=generator), group_size)
