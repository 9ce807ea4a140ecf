"""The log-prob forwards of each batch layout, and the registry that picks one at setup.

A layout is how a batch of rollout rows goes through the model to give the per-token log-probs of
its completions (Phase A's π_old / π_ref passes, Phase B's microbatches):

- `padded`: the rows as they are ([n, Lp + Lc], padding computed);
- `padding_free` (model.padding_free): the rows' real tokens packed into one row;
- `shared_prompt` (model.shared_prompt): each group as one row [prompt | G completions], the
  prompt computed once per group;
- `padding_free+shared_prompt`: one row of the batch's distinct real tokens.

All four give the same log-probs up to the compute dtype's rounding (tests/forward). Each comes
with its chunking of a pass (`forward.buckets`) and whether its batches are whole groups.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from grpolab.algo.logprobs import entropy, fused_token_logprobs, token_logprobs
from grpolab.forward import shared_prompt
from grpolab.forward.attention import PLAN_KWARG, autocast, require_sdpa, use_fast_cpu_attention
from grpolab.forward.buckets import Buckets, balanced_buckets, group_buckets, length_buckets
from grpolab.forward.padded_attention import dummy_rows, padded_count
from grpolab.forward.plans import grouped_rows_plan, packed_rows_plan
from grpolab.batch import position_ids


def _planned(device) -> torch.Tensor:
    """The attention mask passed with an attention plan: a 4-D placeholder, which transformers'
    mask builders return as it is (no [T, T] mask is built); the plan says who attends to whom."""
    return torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)


def padded_completion_logprobs(model, input_ids, attention_mask, prompt_len, temperature=1.0, with_entropy=False,
                               compute_dtype=None, entropy_grad=False):
    """Log-probs of the completion tokens (columns prompt_len..T-1) under `model`, rows as they are.

    input_ids, attention_mask: [n, T]. Returns (logp [n, Lc] float32, entropy [n, Lc] or None).
    Only the positions that predict completion tokens go through the LM head (`logits_to_keep`).
    The entropy is detached unless `entropy_grad` (an entropy bonus in the loss).
    """
    width = input_ids.shape[1]
    if not 1 <= prompt_len < width:
        raise ValueError(f"completion_logprobs: prompt_len={prompt_len} must be in [1, {width}) for input_ids of "
                         f"width {width} (the last prompt position predicts the first completion token)")
    use_fast_cpu_attention(model, compute_dtype, input_ids.device)
    with autocast(compute_dtype, str(input_ids.device)):
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask.long(),
            position_ids=position_ids(attention_mask),
            use_cache=False,
            # position t predicts token t+1: exactly the predictors, so the logits are used unsliced
            # (a slice's backward would zero-fill and copy a gradient of the full logits' size)
            logits_to_keep=torch.arange(prompt_len - 1, width - 1, device=input_ids.device),
        )
    return _logprobs_of(out.logits, input_ids[:, prompt_len:], temperature, with_entropy, entropy_grad)


def _logprobs_of(logits, labels, temperature, with_entropy, entropy_grad):
    """(logp, entropy or None) of `labels` under `logits` [..., V]; see `completion_logprobs`."""
    if with_entropy and entropy_grad:  # an entropy bonus: differentiate the entropy too
        return token_logprobs(logits, labels, temperature), entropy(logits, temperature)
    logp, ent = fused_token_logprobs(logits, labels, temperature, with_entropy)
    return logp, ent if with_entropy else None


def _padded_logprobs_of(logits, labels, temperature, with_entropy, entropy_grad):
    """`_logprobs_of` for the first S = labels.numel() rows of `logits` [S', V] (S' >= S): every
    row is scored (the extra rows against token 0) and the [S'] results are cut to [S]. Slicing the
    logits instead would make their backward write a zero-filled [S', V] gradient and copy the [S, V]
    one into it (two extra passes over the logits per microbatch). Without a
    gradient (the π_old / π_ref passes) the slice is free, and only the S rows are scored."""
    s, extra = labels.numel(), logits.shape[0] - labels.numel()
    if not logits.requires_grad:
        return _logprobs_of(logits[:s], labels, temperature, with_entropy, entropy_grad)
    logp, ent = _logprobs_of(logits, torch.cat([labels, labels.new_zeros(extra)]), temperature, with_entropy,
                             entropy_grad)
    return logp[:s], (ent[:s] if ent is not None else None)


def packed_completion_logprobs(model, input_ids, attention_mask, prompt_len, temperature=1.0, with_entropy=False,
                               compute_dtype=None, entropy_grad=False):
    """`completion_logprobs` without computing padding: the rows' real tokens go through the model
    as one row of R tokens (positions restart at each original row; attention stays within it, see
    `plans.PackedRows`), and the LM head runs only on the positions that predict a real completion
    token. Same arguments and returns; columns that are padding in `attention_mask` get 0.

    Each row's real tokens must be contiguous (a left-padded prompt followed by a right-padded
    completion, as rollouts are); a row with completion tokens needs a real last prompt token.
    The model must run SDPA attention (it is switched to `FAST_CPU_ATTENTION`); else ValueError.
    """
    n, width = input_ids.shape
    real = attention_mask.bool()
    _check_packable(real, prompt_len)
    require_sdpa(model, "model.padding_free")
    lengths = real.sum(-1)
    packed_index = (real.flatten().cumsum(0) - 1).view(n, width)  # each real token's place in the packed row
    scored = real[:, prompt_len:]  # the completion tokens that get a log-prob
    predictors = packed_index[:, prompt_len:][scored] - 1  # each one is predicted by the token before it
    logits = _packed_forward(model, input_ids[real], position_ids(attention_mask)[real], lengths[lengths > 0].cpu(),
                             predictors, compute_dtype)
    logp, ent = _padded_logprobs_of(logits, input_ids[:, prompt_len:][scored], temperature, with_entropy, entropy_grad)
    return _unpack(logp, scored), (_unpack(ent, scored) if ent is not None else None)


def grouped_completion_logprobs(model, input_ids, attention_mask, prompt_len, group_size, temperature=1.0,
                                with_entropy=False, compute_dtype=None, entropy_grad=False):
    """`completion_logprobs` of rows that come in groups of `group_size` sharing one prompt (rows
    g·G .. g·G+G-1), each group forwarded as one row of its prompt and its G completions
    (`shared_prompt.group_layout`): the prompt is computed once per group. Same returns.

    The model must run SDPA attention (it is switched to `FAST_CPU_ATTENTION`); else ValueError.
    """
    layout = shared_prompt.group_layout(input_ids, attention_mask, prompt_len, group_size)
    require_sdpa(model, "model.shared_prompt")
    plan = {PLAN_KWARG: grouped_rows_plan(layout)}
    with autocast(compute_dtype, str(input_ids.device)):
        out = model(input_ids=layout.input_ids, position_ids=layout.position_ids, use_cache=False,
                    logits_to_keep=layout.predictors, attention_mask=_planned(input_ids.device), **plan)
    n, width = input_ids.shape
    u, lc, vocab = n // group_size, width - prompt_len, out.logits.shape[-1]
    labels = input_ids[:, prompt_len:].view(u, group_size, lc)
    # every completion's first token is predicted by its prompt's last position, the others by their own rows;
    # split, not two slices: its backward writes one gradient of the logits' size, not two zero-filled ones
    at_prompt, at_rows = out.logits.split([1, out.logits.shape[1] - 1], dim=1)
    first = _logprobs_of(at_prompt.expand(u, group_size, vocab), labels[:, :, 0], temperature,
                         with_entropy, entropy_grad)
    rest = _logprobs_of(at_rows.view(u, group_size, lc - 1, vocab), labels[:, :, 1:], temperature,
                        with_entropy, entropy_grad)
    logp = torch.cat([first[0][..., None], rest[0]], -1).view(n, lc)
    ent = torch.cat([first[1][..., None], rest[1]], -1).view(n, lc) if with_entropy else None
    return logp, ent


def packed_grouped_completion_logprobs(model, input_ids, attention_mask, prompt_len, group_size, temperature=1.0,
                                       with_entropy=False, compute_dtype=None, entropy_grad=False):
    """`completion_logprobs` with both layouts: one row of the real tokens with each group's prompt
    once (`shared_prompt.packed_group_layout`); attention runs on the original rows, each with its
    prompt (`plans.PackedRows` on copies gathered by index). Same returns; padded columns get 0."""
    _check_packable(attention_mask.bool(), prompt_len)
    layout = shared_prompt.packed_group_layout(input_ids, attention_mask, prompt_len, group_size)
    require_sdpa(model, "model.shared_prompt")
    logits = _packed_forward(model, layout.input_ids[0], layout.position_ids[0], layout.row_lengths.cpu(),
                             layout.predictors, compute_dtype, (layout.expand, layout.collapse))
    scored = layout.scored
    logp, ent = _padded_logprobs_of(logits, input_ids[:, prompt_len:][scored], temperature, with_entropy, entropy_grad)
    return _unpack(logp, scored), (_unpack(ent, scored) if ent is not None else None)


def _packed_forward(model, ids, positions, rows, predictors, compute_dtype, groups=None) -> torch.Tensor:
    """The model's logits [S', V] at `predictors` [S] of one padding-free row (the first S rows;
    S' = `padded_count(S)`, the rest repeat the last predictor): tokens `ids` [T] at `positions`
    [T], original rows of lengths `rows` (CPU; with `groups`, see `plans.PackedRows`).

    The row and the predictors are padded to `padded_count` (dummy rows of token 0, a repeated
    predictor), so the matrix products see few distinct sizes: oneDNN builds a bf16 kernel for
    every new size (on a small model, a cost of the order of the product itself) and keeps it, up
    to a thousand sizes per cache (a peak RSS that grows step after step)."""
    s = predictors.numel()
    lengths = dummy_rows(ids.numel(), s, int(rows.max()) if rows.numel() else 0)
    dummy = torch.arange(sum(lengths), device=ids.device)  # at least one token
    ids = torch.cat([ids, torch.zeros_like(dummy)])
    positions = torch.cat([positions, *(torch.arange(n, device=ids.device) for n in lengths)])
    rows = torch.cat([rows, torch.tensor(lengths)])
    if groups is not None:  # the dummy rows are original rows of their own
        expand, collapse = groups
        groups = (torch.cat([expand, collapse.numel() + dummy]), torch.cat([collapse, expand.numel() + dummy]))
    keep = torch.cat([predictors, predictors[-1:].expand(padded_count(s) - s)]) if s else predictors
    plan = {PLAN_KWARG: packed_rows_plan(rows, groups, ids.device)}
    with autocast(compute_dtype, str(ids.device)):
        out = model(input_ids=ids[None], position_ids=positions[None], use_cache=False, logits_to_keep=keep,
                    attention_mask=_planned(ids.device), **plan)
    return out.logits.view(out.logits.shape[1:])  # a view: its backward copies nothing (see _padded_logprobs_of)


def _unpack(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """[K] values into the True places of `where` [n, Lc] (K of them), 0 elsewhere; differentiable."""
    return values.new_zeros(where.shape).masked_scatter(where, values)


def _check_packable(real: torch.Tensor, prompt_len: int) -> None:
    """ValueError unless each row's real tokens are one contiguous run that, when it reaches the
    completion, includes the last prompt column (so each scored token's predictor is in its row)."""
    starts = real[:, 0].long() + (real[:, 1:] & ~real[:, :-1]).sum(-1)  # runs of real tokens per row
    if bool((starts > 1).any()):
        raise ValueError("model.padding_free: a row's attention_mask has a gap (its real tokens must be "
                         "a left-padded prompt followed by a right-padded completion)")
    if prompt_len < 1 or bool((real[:, prompt_len:].any(-1) & ~real[:, prompt_len - 1]).any()):
        raise ValueError("model.padding_free: a row has completion tokens but no prompt token before them")


def _ignoring_group_size(fn):
    """A layout function without a group size, in the registry's common signature."""
    @functools.wraps(fn)
    def call(model, input_ids, attention_mask, prompt_len, group_size, *args):
        return fn(model, input_ids, attention_mask, prompt_len, *args)
    return call


LogProbFn = Callable[..., tuple[torch.Tensor, "torch.Tensor | None"]]
"""(model, input_ids [n, T], attention_mask [n, T], prompt_len, group_size, temperature,
with_entropy, compute_dtype, entropy_grad) -> (logp [n, Lc] float32, entropy [n, Lc] or None)."""


@dataclass(frozen=True)
class Layout:
    """One batch layout of the log-prob forwards."""

    name: str
    logprobs: LogProbFn
    chunks: Buckets
    """(rollout, rows per chunk) -> row indices per chunk (`forward.buckets`)."""
    whole_groups: bool
    """Batches (chunks, Phase B's minibatches) are whole groups in order."""
    option: str | None
    """The config switch that chose it and needs SDPA attention; None for padded rows."""


LAYOUTS: dict[str, Layout] = {
    "padded": Layout("padded", _ignoring_group_size(padded_completion_logprobs), length_buckets, False, None),
    "padding_free": Layout("padding_free", _ignoring_group_size(packed_completion_logprobs), balanced_buckets, False,
                           "model.padding_free"),
    "shared_prompt": Layout("shared_prompt", grouped_completion_logprobs, group_buckets, True, "model.shared_prompt"),
    "padding_free+shared_prompt": Layout("padding_free+shared_prompt", packed_grouped_completion_logprobs,
                                         functools.partial(balanced_buckets, whole_groups=True), True,
                                         "model.shared_prompt"),
}


def layout_for(padding_free: bool, shared_prompt: bool) -> Layout:
    """The layout of the config switches model.padding_free and model.shared_prompt."""
    names = [n for n, on in (("padding_free", padding_free), ("shared_prompt", shared_prompt)) if on]
    return LAYOUTS["+".join(names) or "padded"]


def completion_logprobs(model, input_ids, attention_mask, prompt_len, temperature=1.0, with_entropy=False,
                        compute_dtype=None, entropy_grad=False, padding_free=False, group_size=None):
    """Log-probs of the completion tokens (columns prompt_len..T-1) under `model`, in the layout of
    `padding_free` and `group_size` (rows g·G .. g·G+G-1 share their prompt; None: no sharing).

    input_ids, attention_mask: [n, T]. Returns (logp [n, Lc] float32, entropy [n, Lc] or None);
    padding-free layouts give 0 on padded columns. A one-off call; a run builds its layout once
    (`forward.LogProbForward`).
    """
    layout = layout_for(padding_free, group_size is not None)
    return layout.logprobs(model, input_ids, attention_mask, prompt_len, group_size, temperature, with_entropy,
                           compute_dtype, entropy_grad)
