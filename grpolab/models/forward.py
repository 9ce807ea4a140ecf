"""Forward passes that give per-token log-probs of completions (Phase A's π_old/π_ref, Phase B's π)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from grpolab.algo.logprobs import entropy, fused_token_logprobs, token_logprobs
from grpolab.models import shared_prompt as prompt_sharing
from grpolab.models.buckets import buckets_for
from grpolab.models.math_attention import short_attention
from grpolab.models.padded_attention import dummy_rows, from_padded, padded_count, padded_maps, to_padded
from grpolab.models.row_attention import per_row_attention
from grpolab.rollout.types import position_ids


def autocast(dtype: torch.dtype | None, device: str = "cpu"):
    """bf16 autocast when asked (master weights stay fp32), else a no-op context."""
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


FAST_CPU_ATTENTION = "grpolab_sdpa"

# The row lengths (int64 [n]) of the padding-free forward in progress (`packed_rows`); None = an ordinary
# padded batch. A module global, not a ContextVar: torch.compile cannot trace ContextVar.get, which broke
# every compiled forward (training and decode) into pieces; a global is a guard. A tensor, not a tuple:
# traced code sees a graph input, not values it would guard on, so new row lengths reuse the compiled
# graphs. Forwards run on one thread.
_PACKED_LENGTHS: torch.Tensor | None = None

# The index maps (gather, scatter, visible) of `padded_attention.padded_maps` for the padding-free forward in
# progress when its rows are short (`packed_rows`); None otherwise. A module global like _PACKED_LENGTHS.
_PADDED_MAPS: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def _bf16_on_cpu(query: torch.Tensor) -> bool:
    """True when this attention computes in bf16 on a CPU (bf16 inputs or bf16 autocast)."""
    on_cpu = query.device.type == "cpu"
    return on_cpu and (query.dtype == torch.bfloat16 or (
        torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16))


def _upcast_for_grad(query: torch.Tensor) -> bool:
    """True when this attention is differentiated in bf16 on a CPU (see `sdpa_fp32_grad_attention`)."""
    return _bf16_on_cpu(query) and torch.is_grad_enabled() and query.requires_grad


def sdpa_fp32_grad_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention, with faster paths for bf16 on a CPU.

    - Sequences of at most `SHORT_ATTENTION_MAX_TOKENS` (queries and keys; not a one-token decode
      step): `short_attention`, two bf16 matmuls around a float32 softmax, with or without grad.
      PyTorch's CPU flash kernel is slow on short rows (per (row, head) overhead).
    - Longer ones, differentiated: SDPA in float32. PyTorch's CPU flash-attention backward is 4-5x
      slower in bf16 than in fp32 (measured on this machine, torch 2.13: [32, 4, 38, 64] fwd+bwd
      50-68 ms vs 12-13 ms). Inference keeps the bf16 kernel.
    Inside `packed_rows` the batch is one padding-free row and each original row attends only to
    itself (`packed_attention`); inside `shared_prompt.grouped_rows` a row is a group's prompt and
    completions (`shared_prompt.split_attention`); a decode step traced by torch.compile runs `decode_attention`
    (rollout/static.py). A padding-free batch of short rows computed in bf16 on a CPU runs
    `short_attention` on its rows gathered right-padded (`padded_attention`).
    query/key/value: [B, H, T, D] (fp32 under autocast: the rotary embedding upcasts them). Returns
    (output [B, T, H, D], None); bf16 on the bf16 paths, as autocast's SDPA would return.
    """
    if _PADDED_MAPS is not None and _pads_short_rows(query, kwargs):
        return _short_rows_attention(query, key, value, kwargs.get("scaling")), None
    if prompt_sharing.PACKED_GROUPS is not None:  # each original row's attention, its prompt copied in
        expand, collapse = prompt_sharing.PACKED_GROUPS
        out, _ = packed_attention(module, *(t.index_select(2, expand) for t in (query, key, value)), **kwargs)
        return out.index_select(1, collapse), None
    if _PACKED_LENGTHS is not None:
        return packed_attention(module, query, key, value, **kwargs)
    if prompt_sharing.GROUP_MASKS is not None:
        if kwargs.get("sliding_window") is not None:  # the padded forward's mask carries the window; ours do not
            raise ValueError("model.shared_prompt: this model's attention uses a sliding window, which the "
                             "grouped forward does not implement; set model.shared_prompt=false")
        return prompt_sharing.split_attention(
            query, key, value, lambda q, k, v, mask: _row_attention(module, q, k, v, mask, kwargs)[0]), None
    if _is_compiled_decode(query, key, attention_mask, kwargs):
        return decode_attention(query, key, value, attention_mask, kwargs.get("scaling"))
    return _row_attention(module, query, key, value, attention_mask, kwargs)


def _row_attention(module, query, key, value, attention_mask, kwargs):
    """`sdpa_fp32_grad_attention` on ordinary rows: `short_attention`, float32 SDPA for a bf16
    backward, or transformers' SDPA. Returns (output [B, Lq, H, D], weights or None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _is_short(module, query, key, attention_mask, kwargs):
        return short_attention(query, key, value, attention_mask, kwargs.get("scaling")), None
    if not _upcast_for_grad(query):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    with torch.autocast("cpu", enabled=False):
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(),
                                              attention_mask, **kwargs)
    return out.to(torch.bfloat16), weights


SHORT_ATTENTION_MAX_TOKENS = 128
"""The longest query or key length that `short_attention` serves. Measured on this machine (torch 2.13,
bench/README.md), [B, 4, L, 64] with B·L ≈ 1216, forward and backward: `short_attention` 2.9 ms against
6.3 ms for float32 SDPA at L = 38, 6.5 against 9.1 at 128, 15.1 against 11.0 at 256."""


def _is_short(module, query, key, attention_mask, kwargs) -> bool:
    """True where `short_attention` computes what SDPA would: bf16 on a CPU, 1 < queries and keys
    <= SHORT_ATTENTION_MAX_TOKENS, no dropout, soft cap or position bias, and a boolean 4-D mask or
    none with equal query and key lengths (then the attention is causal)."""
    lq, lk = query.shape[2], key.shape[2]
    if not (1 < lq <= SHORT_ATTENTION_MAX_TOKENS and lk <= SHORT_ATTENTION_MAX_TOKENS and _bf16_on_cpu(query)):
        return False
    if kwargs.get("dropout", 0.0) or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        return False
    if attention_mask is None:
        causal = kwargs.get("is_causal")
        return lq == lk and (getattr(module, "is_causal", True) if causal is None else causal)
    return attention_mask.dtype == torch.bool and attention_mask.dim() == 4


def _pads_short_rows(query, kwargs) -> bool:
    """True where `_short_rows_attention` computes what `packed_attention` would: bf16 on a CPU, no
    dropout, soft cap, sliding window or position bias (`packed_attention` rejects the last ones)."""
    plain = not kwargs.get("dropout", 0.0) and all(
        kwargs.get(name) is None for name in ("softcap", "sliding_window", "position_bias"))
    return plain and _bf16_on_cpu(query)


def _short_rows_attention(query, key, value, scaling=None):
    """`short_attention` of the padding-free batch's rows, gathered right-padded by the current
    `_PADDED_MAPS` and back: ([1, K, H, D] bf16)."""
    gather, scatter, visible = _PADDED_MAPS
    q, k, v = (to_padded(t.to(torch.bfloat16), gather) for t in (query, key, value))
    # right-padded rows under a causal mask: every query sees at least its row's first token
    return from_padded(short_attention(q, k, v, visible, scaling, every_query_sees_a_key=True), scatter)


def decode_attention(query, key, value, attention_mask=None, scaling=None):
    """Attention of one new token per row (a decode step), in float32, as plain tensor ops.

    query: [B, H, 1, D]; key, value: [B, Hkv, L, D] (H a multiple of Hkv); attention_mask: None,
    or bool (True = attend) or additive float, broadcastable to [B, 1, 1, L]; scaling: None means
    D ** -0.5. Returns ([B, 1, H, D] in query's dtype, None), as transformers' SDPA attention.

    For the compiled decode loop (rollout/static.py): PyTorch's CPU SDPA kernel handles one query
    row per (row, head) poorly (bench fixture, [128, 4, 1, 64] over a 48-wide cache: about 1.6 ms
    per layer), while these ops compile into a few fused loops over the cache. Eager, they are
    slower than SDPA: only `sdpa_fp32_grad_attention` under torch.compile calls this.
    """
    b, h, _, d = query.shape
    groups, width = h // key.shape[1], key.shape[2]
    if groups > 1:  # grouped-query attention: key/value head j serves query heads j·groups ...
        key = key[:, :, None].expand(-1, -1, groups, -1, -1).reshape(b, h, width, d)
        value = value[:, :, None].expand(-1, -1, groups, -1, -1).reshape(b, h, width, d)
    scores = (query.float() * key.float()).sum(-1) * (d**-0.5 if scaling is None else scaling)  # [B, H, L]
    if attention_mask is not None:
        mask = attention_mask.reshape(attention_mask.shape[0], 1, width)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    out = (scores.softmax(-1)[..., None] * value.float()).sum(-2)  # [B, H, D]
    return out[:, None].to(query.dtype), None


def _is_compiled_decode(query, key, attention_mask, kwargs) -> bool:
    """True for a decode step (one query position, no grad) traced by torch.compile, with a mask
    that `decode_attention` takes ([B or 1, 1, 1, L] over the whole cache) and no soft cap."""
    return (query.shape[2] == 1 and torch.compiler.is_compiling() and not torch.is_grad_enabled()
            and kwargs.get("softcap") is None and kwargs.get("dropout", 0.0) == 0.0
            and (attention_mask is None or tuple(attention_mask.shape[1:]) == (1, 1, key.shape[2])))


def packed_attention(module, query, key, value, *, scaling=None, dropout=0.0, **kwargs):
    """Causal attention within each row of a padding-free batch (`packed_rows`): one SDPA call per row.

    query: [1, H, R, D]; key, value: [1, Hkv, R, D] (H a multiple of Hkv); the rows' lengths sum to
    R. No attention crosses a row boundary and no padding is computed. Differentiated in bf16 on a
    CPU, it runs in float32 like `sdpa_fp32_grad_attention`. Returns ([1, R, H, D], None).
    Sliding-window and soft-capped attention are not supported (ValueError).
    """
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise ValueError("model.padding_free: this model's attention uses a sliding window or a soft cap, "
                         "which the padding-free forward does not implement; set model.padding_free=false")
    upcast = _upcast_for_grad(query)
    device = query.device.type
    with torch.autocast(device, enabled=False) if upcast else contextlib.nullcontext():
        if upcast:
            query, key, value = query.float(), key.float(), value.float()
        elif torch.is_autocast_enabled(device):  # SDPA's autocast rule, which a custom op does not get
            dtype = torch.get_autocast_dtype(device)
            query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        p = dropout if module.training else 0.0
        if device == "cpu" and p == 0.0:
            out = per_row_attention(query, key, value, _PACKED_LENGTHS, scaling)[0]
        else:
            out = _per_row_sdpa(query, key, value, scaling, p)
    return (out.to(torch.bfloat16) if upcast else out), None


@torch.compiler.disable
def _per_row_sdpa(query, key, value, scaling, dropout_p):
    """The per-row SDPA calls of `packed_attention` over the current `_PACKED_LENGTHS` ([1, R, H, D] out),
    where `row_attention.per_row_attention` does not apply (dropout, devices other than the CPU).

    Run eagerly under torch.compile (model.compile): a traced loop over the rows would recompile for
    each new set of rows; here the compiled graph breaks around each layer's attention instead."""
    rows = _PACKED_LENGTHS.tolist()
    # split (not slicing): its backward is one cat, not a zero-filled full-size gradient per row
    parts = [F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scaling,
                                            enable_gqa=q.shape[1] != k.shape[1])
             for q, k, v in zip(query.split(rows, 2), key.split(rows, 2), value.split(rows, 2))]
    return torch.cat(parts, 2).transpose(1, 2).contiguous()


def _attention_mask_for(*args, **kwargs):
    """The mask factory registered with `FAST_CPU_ATTENTION`: transformers' SDPA mask, or None inside
    `packed_rows` (`packed_attention` needs none; this skips building an [R, R] block mask)."""
    from transformers.masking_utils import sdpa_mask

    return None if _PACKED_LENGTHS is not None or prompt_sharing.GROUP_MASKS is not None else sdpa_mask(*args, **kwargs)


def _switch_attention(model: torch.nn.Module) -> bool:
    """Puts a model that runs SDPA attention on `FAST_CPU_ATTENTION`; False if it cannot be."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl == FAST_CPU_ATTENTION:
        return True
    if impl != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if FAST_CPU_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(FAST_CPU_ATTENTION, sdpa_fp32_grad_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(FAST_CPU_ATTENTION, _attention_mask_for)
    model.set_attn_implementation(FAST_CPU_ATTENTION)
    return True


def use_fast_cpu_attention(model: torch.nn.Module, compute_dtype: torch.dtype | None, device) -> None:
    """Switches a model on SDPA attention to `sdpa_fp32_grad_attention` for bf16 on CPU (idempotent).

    Other models, dtypes and devices are left alone. Inference numerics change only where
    `short_attention` replaces bf16 SDPA (short sequences), to bf16 rounding.
    """
    if compute_dtype == torch.bfloat16 and torch.device(device).type == "cpu":
        _switch_attention(model)


@contextlib.contextmanager
def packed_rows(rows, groups=None, device="cpu"):
    """Within this block, forwards of models on `FAST_CPU_ATTENTION` treat their single input row as
    `rows` back-to-back sequences (lengths: a sequence of ints or an int tensor on the CPU, summing
    to the row's width). groups: the (expand, collapse) maps of `shared_prompt.packed_group_layout`
    when the row holds each group's prompt once (the rows are then the original rows, see
    `shared_prompt.packed_groups`). Rows of at most SHORT_ATTENTION_MAX_TOKENS forwarded on a CPU
    (`device`, the row's) get the index maps of the padded attention (`padded_attention.padded_maps`)."""
    global _PACKED_LENGTHS, _PADDED_MAPS
    lengths = torch.as_tensor(rows, dtype=torch.int64)
    on_cpu = torch.device(device).type == "cpu"
    short = on_cpu and lengths.numel() > 0 and int(lengths.max()) <= SHORT_ATTENTION_MAX_TOKENS
    previous = _PACKED_LENGTHS, _PADDED_MAPS
    _PACKED_LENGTHS = lengths
    _PADDED_MAPS = padded_maps(lengths, *(groups or ())) if short else None
    try:
        with prompt_sharing.packed_groups(*groups) if groups else contextlib.nullcontext():
            yield
    finally:
        _PACKED_LENGTHS, _PADDED_MAPS = previous


def completion_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    compute_dtype: torch.dtype | None = None,
    entropy_grad: bool = False,
    padding_free: bool = False,
    group_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the completion tokens (columns prompt_len..T-1) under `model`.

    input_ids, attention_mask: [n, T]. Returns (logp [n, Lc] float32, entropy [n, Lc] or None).
    Only the positions that predict completion tokens go through the LM head (`logits_to_keep`).
    The entropy is detached unless `entropy_grad` (an entropy bonus in the loss). padding_free:
    forward only the real tokens, packed into one row (`packed_completion_logprobs`); padded
    columns then get 0. group_size: rows g·G .. g·G+G-1 share their prompt, which is forwarded
    once per group (`grouped_completion_logprobs`); with padding_free too, only real tokens and each
    prompt once (`packed_grouped_completion_logprobs`).
    """
    if padding_free and group_size is not None:
        return packed_grouped_completion_logprobs(model, input_ids, attention_mask, prompt_len, group_size,
                                                  temperature, with_entropy, compute_dtype, entropy_grad)
    if padding_free:
        return packed_completion_logprobs(model, input_ids, attention_mask, prompt_len, temperature,
                                          with_entropy, compute_dtype, entropy_grad)
    if group_size is not None:
        return grouped_completion_logprobs(model, input_ids, attention_mask, prompt_len, group_size, temperature,
                                           with_entropy, compute_dtype, entropy_grad)
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
    one into it (SmolLM2, 128 rows × 32 tokens: two passes over 240 MB per microbatch). Without a
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
    `packed_attention`), and the LM head runs only on the positions that predict a real completion
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
    layout = prompt_sharing.group_layout(input_ids, attention_mask, prompt_len, group_size)
    require_sdpa(model, "model.shared_prompt")
    with prompt_sharing.grouped_rows(layout), autocast(compute_dtype, str(input_ids.device)):
        out = model(input_ids=layout.input_ids, position_ids=layout.position_ids, use_cache=False,
                    logits_to_keep=layout.predictors)
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
    prompt (`packed_attention` on copies gathered by index). Same returns; padded columns get 0."""
    _check_packable(attention_mask.bool(), prompt_len)
    layout = prompt_sharing.packed_group_layout(input_ids, attention_mask, prompt_len, group_size)
    require_sdpa(model, "model.shared_prompt")
    logits = _packed_forward(model, layout.input_ids[0], layout.position_ids[0], layout.row_lengths.cpu(),
                             layout.predictors, compute_dtype, (layout.expand, layout.collapse))
    scored = layout.scored
    logp, ent = _padded_logprobs_of(logits, input_ids[:, prompt_len:][scored], temperature, with_entropy, entropy_grad)
    return _unpack(logp, scored), (_unpack(ent, scored) if ent is not None else None)


def _packed_forward(model, ids, positions, rows, predictors, compute_dtype, groups=None) -> torch.Tensor:
    """The model's logits [S', V] at `predictors` [S] of one padding-free row (the first S rows;
    S' = `padded_count(S)`, the rest repeat the last predictor): tokens `ids` [T] at `positions`
    [T], original rows of lengths `rows` (CPU; with `groups`, see `packed_rows`).

    The row and the predictors are padded to `padded_count` (dummy rows of token 0, a repeated
    predictor), so the matrix products see few distinct sizes: oneDNN builds a bf16 kernel for
    every new size (about as long as the product itself on the bench fixture) and keeps it, up to
    a thousand sizes per cache (an RSS that grew by 50-70 MB a step, bench/README.md)."""
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
    with packed_rows(rows, groups, ids.device), autocast(compute_dtype, str(ids.device)):
        out = model(input_ids=ids[None], position_ids=positions[None], use_cache=False, logits_to_keep=keep)
    return out.logits.view(out.logits.shape[1:])  # a view: its backward copies nothing (see _padded_logprobs_of)


def require_sdpa(model, option: str) -> None:
    """Switches `model` to `FAST_CPU_ATTENTION`; ValueError naming `option` if it does not run SDPA.
    Idempotent; the training setup calls it before the first rollout (a compiled decode step traced
    before the switch would compile again at the next rollout)."""
    if not _switch_attention(model):
        raise ValueError(f"{option} needs a model with SDPA attention (attn_implementation='sdpa'); "
                         f"this one runs {getattr(getattr(model, 'config', None), '_attn_implementation', None)!r}")


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


@torch.no_grad()
def batched_logprobs(model, rollout, temperature: float, batch_size: int, compute_dtype=None,
                     padding_free: bool = False, shared_prompt: bool = False) -> torch.Tensor:
    """No-grad log-probs of every completion token of a Rollout, in chunks of `batch_size` rows.

    Rows are chunked by `models.buckets.buckets_for`: of similar length (little padding per chunk),
    or, padding-free, with about equal real tokens per chunk.
    Returns [N, Lc] float32 aligned with rollout.loss_mask (0 beyond each chunk's trimmed width).
    padding_free: each chunk forwards only its real tokens (`packed_completion_logprobs`).
    shared_prompt: chunks are whole groups, each prompt forwarded once per group
    (`grouped_completion_logprobs`; batch_size a multiple of the group size).
    """
    n, lc = rollout.loss_mask.shape
    out = torch.zeros(n, lc, dtype=torch.float32, device=rollout.loss_mask.device)
    buckets = buckets_for(padding_free, shared_prompt)
    group_size = rollout.group_size if shared_prompt else None
    with autocast(compute_dtype, str(rollout.input_ids.device)):  # trainable weights cast once, not per chunk
        for idx in buckets(rollout, batch_size):
            sub = rollout.select(idx)
            lp, _ = completion_logprobs(model, sub.input_ids, sub.attention_mask, sub.prompt_len, temperature,
                                        compute_dtype=compute_dtype, padding_free=padding_free,
                                        group_size=group_size)
            out[idx, : lp.shape[1]] = lp.float().to(out.device)
    if out.device.type == "cpu":
        from grpolab.rollout.hf import release_free_memory

        release_free_memory()
    return out
