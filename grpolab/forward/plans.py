"""Attention plans: how `attention.grpolab_attention` attends in a padding-free or grouped forward.

A log-prob forward in another layout than padded rows builds one plan per model call and passes it
as the keyword `attention.PLAN_KWARG`; transformers hands it to every layer's attention, and the
plan's `attend(module, query, key, value, kwargs)` computes that layer's attention
([B, H, T, D] inputs, [B, T, H, D] output):

- `PackedRows`: the batch is one row of back-to-back original rows (padding-free); each attends
  only to itself. Rows of at most `SHORT_ATTENTION_MAX_TOKENS` on a CPU are gathered right-padded
  (`padded_attention`) for `short_attention` in bf16, for one causal SDPA call in float32; others
  run one SDPA call per row
  (`row_attention.per_row_attention` on a CPU). With `groups` the row holds each group's prompt
  once (`shared_prompt.packed_group_layout`): the original rows are gathered by index first.
- `GroupedRows`: each row is a group's prompt and its G completions
  (`shared_prompt.group_layout`); attention is computed in the ordinary row layout
  (`shared_prompt.split_attention`).

Plans hold tensors (graph inputs under torch.compile: new row lengths reuse a compiled graph) and
G as a Python int (one per run).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grpolab.forward.attention import SHORT_ATTENTION_MAX_TOKENS, bf16_on_cpu, row_attention, upcast_for_grad
from grpolab.forward.math_attention import short_attention
from grpolab.forward.padded_attention import from_padded, padded_maps, to_padded
from grpolab.forward.row_attention import per_row_attention
from grpolab.forward.shared_prompt import split_attention


@dataclass(frozen=True)
class PackedRows:
    """One padding-free row of original rows of `lengths` tokens each."""

    lengths: torch.Tensor
    """[rows] int64 on the CPU: the original rows' lengths (they sum to the row's width R)."""
    padded: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """The (gather, scatter, visible) maps of `padded_attention.padded_maps` when the rows are short
    and on a CPU; None otherwise."""
    groups: tuple[torch.Tensor, torch.Tensor] | None = None
    """(expand [R], collapse [K]) of `shared_prompt.packed_group_layout`: the row holds K tokens,
    each group's prompt once; attention runs on the R tokens of the original rows."""

    def attend(self, module, query, key, value, kwargs) -> torch.Tensor:
        if self.padded is not None and _plain(kwargs):
            if bf16_on_cpu(query):
                return self.short_rows_attention(query, key, value, kwargs.get("scaling"))
            if query.dtype == torch.float32:
                return self.short_rows_sdpa(query, key, value, kwargs.get("scaling"))
        if self.groups is not None:  # each original row's attention, its prompt copied in
            expand, collapse = self.groups
            out = self.packed_attention(module, *(t.index_select(2, expand) for t in (query, key, value)), **kwargs)
            return out.index_select(1, collapse)
        return self.packed_attention(module, query, key, value, **kwargs)

    def short_rows_attention(self, query, key, value, scaling=None) -> torch.Tensor:
        """`short_attention` of the rows, gathered right-padded by `padded` and back: [1, K, H, D] bf16."""
        gather, scatter, visible = self.padded
        q, k, v = (to_padded(t.to(torch.bfloat16), gather) for t in (query, key, value))
        # right-padded rows under a causal mask: every query sees at least its row's first token
        return from_padded(short_attention(q, k, v, visible, scaling, every_query_sees_a_key=True), scatter)

    def short_rows_sdpa(self, query, key, value, scaling=None) -> torch.Tensor:
        """float32: the rows gathered right-padded by `padded`, one causal SDPA call over them all, and
        back: [1, K, H, D]. Causal over right-padded rows, a real query sees only its row's real keys;
        the padding slots' outputs are dropped and get no gradient."""
        gather, scatter, _ = self.padded
        q, k, v = (to_padded(t, gather) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return from_padded(out.transpose(1, 2), scatter)

    def packed_attention(self, module, query, key, value, *, scaling=None, dropout=0.0, **kwargs) -> torch.Tensor:
        """Causal attention within each row: one SDPA call per row.

        query: [1, H, R, D]; key, value: [1, Hkv, R, D] (H a multiple of Hkv). No attention crosses
        a row boundary and no padding is computed. Differentiated in bf16 on a CPU, it runs in
        float32 (`attention.upcast_for_grad`). Returns [1, R, H, D]. Sliding-window and
        soft-capped attention are not supported (ValueError).
        """
        if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
            raise ValueError("model.padding_free: this model's attention uses a sliding window or a soft cap, "
                             "which the padding-free forward does not implement; set model.padding_free=false")
        upcast = upcast_for_grad(query)
        device = query.device.type
        with torch.autocast(device, enabled=False) if upcast else contextlib.nullcontext():
            if upcast:
                query, key, value = query.float(), key.float(), value.float()
            elif torch.is_autocast_enabled(device):  # SDPA's autocast rule, which a custom op does not get
                dtype = torch.get_autocast_dtype(device)
                query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
            p = dropout if module.training else 0.0
            if device == "cpu" and p == 0.0:
                out = per_row_attention(query, key, value, self.lengths, scaling)[0]
            else:
                out = per_row_sdpa(query, key, value, self.lengths, scaling, p)
        return out.to(torch.bfloat16) if upcast else out


def packed_rows_plan(rows, groups=None, device="cpu") -> PackedRows:
    """The plan of one padding-free row of `rows` back-to-back sequences (a sequence of ints or an
    int tensor on the CPU, summing to the row's width); `groups` as `PackedRows.groups`. Rows of
    at most SHORT_ATTENTION_MAX_TOKENS forwarded on a CPU (`device`, the row's) get the maps of the
    padded attention."""
    lengths = torch.as_tensor(rows, dtype=torch.int64)
    on_cpu = torch.device(device).type == "cpu"
    short = on_cpu and lengths.numel() > 0 and int(lengths.max()) <= SHORT_ATTENTION_MAX_TOKENS
    return PackedRows(lengths, padded_maps(lengths, *(groups or ())) if short else None, groups)


def _plain(kwargs) -> bool:
    """True where the padded attention of short rows (`short_rows_attention` in bf16, `short_rows_sdpa`
    in float32) computes what `packed_attention` would: no dropout, soft cap, sliding window or
    position bias (`packed_attention` rejects the last ones)."""
    return not kwargs.get("dropout", 0.0) and all(
        kwargs.get(name) is None for name in ("softcap", "sliding_window", "position_bias"))


@torch.compiler.disable
def per_row_sdpa(query, key, value, lengths, scaling, dropout_p):
    """The per-row SDPA calls of `packed_attention` ([1, R, H, D] out), where
    `row_attention.per_row_attention` does not apply (dropout, devices other than the CPU).

    Run eagerly under torch.compile (model.compile): a traced loop over the rows would recompile for
    each new set of rows; here the compiled graph breaks around each layer's attention instead."""
    rows = lengths.tolist()
    # split (not slicing): its backward is one cat, not a zero-filled full-size gradient per row
    parts = [F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scaling,
                                            enable_gqa=q.shape[1] != k.shape[1])
             for q, k, v in zip(query.split(rows, 2), key.split(rows, 2), value.split(rows, 2))]
    return torch.cat(parts, 2).transpose(1, 2).contiguous()


@dataclass(frozen=True)
class GroupedRows:
    """Rows of [prompt | G completions] (`shared_prompt.group_layout`)."""

    prompt_attend: torch.Tensor
    """[U, 1, Lp, Lp] bool: causal over the prompt's real tokens."""
    completion_attend: torch.Tensor
    """[U·G, 1, Lc, Lp + Lc] bool: the prompt's real tokens, then causal within the completion."""
    group_size: int
    """G, a Python int (`shared_prompt.split_attention` says why)."""

    def attend(self, module, query, key, value, kwargs) -> torch.Tensor:
        if kwargs.get("sliding_window") is not None:  # the padded forward's mask carries the window; ours do not
            raise ValueError("model.shared_prompt: this model's attention uses a sliding window, which the "
                             "grouped forward does not implement; set model.shared_prompt=false")
        return split_attention(query, key, value, self.prompt_attend, self.completion_attend, self.group_size,
                               lambda q, k, v, mask: row_attention(module, q, k, v, mask, kwargs)[0])


def grouped_rows_plan(layout) -> GroupedRows:
    """The plan of a `shared_prompt.GroupLayout`."""
    group_size = layout.completion_attend.shape[0] // layout.prompt_attend.shape[0]
    return GroupedRows(layout.prompt_attend, layout.completion_attend, group_size)
