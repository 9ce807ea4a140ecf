"""grpolab's attention for transformers models: one function registered as `FAST_CPU_ATTENTION`.

A model put on it (`require_sdpa`, `use_fast_cpu_attention`) computes what transformers' SDPA
attention computes, with faster paths for bf16 on a CPU, and takes the layout of a padding-free or
grouped log-prob forward from the call itself: the forward passes an attention plan
(`forward.plans`) as the keyword argument `PLAN_KWARG`, which transformers hands through the
decoder layers to the attention function. Nothing is announced through module state, so a plan
is a graph input under torch.compile and two models can run different layouts.
"""

from __future__ import annotations

import contextlib

import torch

from grpolab.forward.math_attention import short_attention

FAST_CPU_ATTENTION = "grpolab_sdpa"

PLAN_KWARG = "grpolab_plan"
"""The model-call keyword that carries an attention plan (`forward.plans`) to `grpolab_attention`."""

SHORT_ATTENTION_MAX_TOKENS = 128
"""The longest query or key length that `short_attention` serves: beyond it, PyTorch's fused
kernels are faster than two bf16 matmuls around a float32 softmax."""


def autocast(dtype: torch.dtype | None, device: str = "cpu"):
    """bf16 autocast when asked (master weights stay fp32), else a no-op context."""
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def bf16_on_cpu(query: torch.Tensor) -> bool:
    """True when this attention computes in bf16 on a CPU (bf16 inputs or bf16 autocast)."""
    on_cpu = query.device.type == "cpu"
    return on_cpu and (query.dtype == torch.bfloat16 or (
        torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16))


def upcast_for_grad(query: torch.Tensor) -> bool:
    """True when this attention is differentiated in bf16 on a CPU, where PyTorch's flash-attention
    backward is much slower in bf16 than in float32: such attention runs in float32."""
    return bf16_on_cpu(query) and torch.is_grad_enabled() and query.requires_grad


def grpolab_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention, with faster paths for bf16 on a CPU.

    With a plan in kwargs[`PLAN_KWARG`] the batch is in that plan's layout and the plan computes
    the attention (`attention_mask` is then a placeholder). Otherwise, ordinary rows:
    - a decode step traced by torch.compile: `decode_attention`;
    - rows of at most `SHORT_ATTENTION_MAX_TOKENS` in bf16 on a CPU: `short_attention`;
    - longer ones, differentiated in bf16 on a CPU: SDPA in float32 (`upcast_for_grad`);
    - else transformers' SDPA.
    query/key/value: [B, H, T, D] (fp32 under autocast: the rotary embedding upcasts them). Returns
    (output [B, T, H, D], None or weights); bf16 on the bf16 paths, as autocast's SDPA would return.
    """
    plan = kwargs.pop(PLAN_KWARG, None)
    if plan is not None:
        return plan.attend(module, query, key, value, kwargs), None
    if _is_compiled_decode(query, key, attention_mask, kwargs):
        return decode_attention(query, key, value, attention_mask, kwargs.get("scaling"))
    return row_attention(module, query, key, value, attention_mask, kwargs)


def row_attention(module, query, key, value, attention_mask, kwargs):
    """`grpolab_attention` on ordinary rows: `short_attention`, float32 SDPA for a bf16 backward,
    or transformers' SDPA. Returns (output [B, Lq, H, D], weights or None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if is_short(module, query, key, attention_mask, kwargs):
        return short_attention(query, key, value, attention_mask, kwargs.get("scaling")), None
    if not upcast_for_grad(query):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    with torch.autocast("cpu", enabled=False):
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(),
                                              attention_mask, **kwargs)
    return out.to(torch.bfloat16), weights


def is_short(module, query, key, attention_mask, kwargs) -> bool:
    """True where `short_attention` computes what SDPA would: bf16 on a CPU, 1 < queries and keys
    <= SHORT_ATTENTION_MAX_TOKENS, no dropout, soft cap or position bias, and a boolean 4-D mask or
    none with equal query and key lengths (then the attention is causal)."""
    lq, lk = query.shape[2], key.shape[2]
    if not (1 < lq <= SHORT_ATTENTION_MAX_TOKENS and lk <= SHORT_ATTENTION_MAX_TOKENS and bf16_on_cpu(query)):
        return False
    if kwargs.get("dropout", 0.0) or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        return False
    if attention_mask is None:
        causal = kwargs.get("is_causal")
        return lq == lk and (getattr(module, "is_causal", True) if causal is None else causal)
    return attention_mask.dtype == torch.bool and attention_mask.dim() == 4


def decode_attention(query, key, value, attention_mask=None, scaling=None):
    """Attention of one new token per row (a decode step), in float32, as plain tensor ops.

    query: [B, H, 1, D]; key, value: [B, Hkv, L, D] (H a multiple of Hkv); attention_mask: None,
    or bool (True = attend) or additive float, broadcastable to [B, 1, 1, L]; scaling: None means
    D ** -0.5. Returns ([B, 1, H, D] in query's dtype, None), as transformers' SDPA attention.

    For the compiled decode loop (rollout/static.py): PyTorch's CPU SDPA kernel handles one query
    row per (row, head) poorly, while these ops compile into a few fused loops over the cache.
    Eager, they are slower than SDPA: only `grpolab_attention` under torch.compile calls this.
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


def _switch_attention(model: torch.nn.Module) -> bool:
    """Puts a model that runs SDPA attention on `FAST_CPU_ATTENTION`; False if it cannot be."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl == FAST_CPU_ATTENTION:
        return True
    if impl != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if FAST_CPU_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(FAST_CPU_ATTENTION, grpolab_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(FAST_CPU_ATTENTION, sdpa_mask)
    model.set_attn_implementation(FAST_CPU_ATTENTION)
    return True


def use_fast_cpu_attention(model: torch.nn.Module, compute_dtype: torch.dtype | None, device) -> None:
    """Switches a model on SDPA attention to `grpolab_attention` for bf16 on CPU (idempotent).

    Other models, dtypes and devices are left alone. Inference numerics change only where
    `short_attention` replaces bf16 SDPA (short sequences), to bf16 rounding.
    """
    if compute_dtype == torch.bfloat16 and torch.device(device).type == "cpu":
        _switch_attention(model)


def require_sdpa(model, option: str) -> None:
    """Switches `model` to `FAST_CPU_ATTENTION`; ValueError naming `option` if it does not run SDPA.
    Idempotent; the training setup calls it before the first rollout (a compiled decode step traced
    before the switch would compile again at the next rollout)."""
    if not _switch_attention(model):
        raise ValueError(f"{option} needs a model with SDPA attention (attn_implementation='sdpa'); "
                         f"this one runs {getattr(getattr(model, 'config', None), '_attn_implementation', None)!r}")
