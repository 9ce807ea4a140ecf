"""A pre-allocated KV cache for the sampling loop: one buffer per layer, written in place.

transformers' `DynamicCache` concatenates each new key/value onto the cache at every decode step
(a copy of the whole cache per step and layer: O(T²) bytes moved per sequence). Here each layer
allocates [B, H, prompt + max_new_tokens, D] once, at prefill, and a decode step writes one
column; attention reads a view of the filled part. The two operations the engine needs are kept:
`batch_repeat_interleave` (share a prompt's prefill among its G samples) and
`batch_select_indices` (drop finished rows; only the filled columns are copied).

Numerics: the keys/values are the same tensors a DynamicCache would hold (same dtype, same
values), so logits and samples do not change (tests/rollout/test_cache.py).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """The KV cache of one attention layer, in a buffer with room for `extra_tokens` more columns."""

    def __init__(self, extra_tokens: int):
        super().__init__()
        self.extra_tokens = extra_tokens
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def _alloc(self, k: torch.Tensor, v: torch.Tensor, rows: int, capacity: int) -> None:
        self._k = k.new_empty(rows, k.shape[1], capacity, k.shape[-1])
        self._v = v.new_empty(rows, v.shape[1], capacity, v.shape[-1])

    def _refresh(self) -> None:
        self.keys = self._k[:, :, : self.length]
        self.values = self._v[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Writes [B, H, q, D] new keys/values after the filled columns; returns views [B, H, T, D]."""
        q = key_states.shape[-2]
        if not self.is_initialized:
            self.device = key_states.device
            self._alloc(key_states, value_states, key_states.shape[0], q + self.extra_tokens)
            self.is_initialized = True
        if self.length + q > self._k.shape[-2]:  # more tokens than planned: grow (rare)
            old_k, old_v = self._k, self._v
            self._alloc(old_k, old_v, old_k.shape[0], 2 * (self.length + q))
            self._k[:, :, : self.length] = old_k[:, :, : self.length]
            self._v[:, :, : self.length] = old_v[:, :, : self.length]
        self._k[:, :, self.length : self.length + q] = key_states
        self._v[:, :, self.length : self.length + q] = value_states
        self.length += q
        self._refresh()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        self._k = self._v = None
        self.length = 0
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop: tokens_to_remove must be ≤ 0, got {tokens_to_remove}")
        if tokens_to_remove and self.is_initialized:
            self.length = max(0, self.length + tokens_to_remove)
            self._refresh()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.length > 0:
            self._k = self._k.repeat_interleave(repeats, dim=0)
            self._v = self._v.repeat_interleave(repeats, dim=0)
            self._refresh()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.length > 0:
            k, v = self._k, self._v
            self._alloc(k, v, len(indices), k.shape[-2])
            torch.index_select(k[:, :, : self.length], 0, indices, out=self._k[:, :, : self.length])
            torch.index_select(v[:, :, : self.length], 0, indices, out=self._v[:, :, : self.length])
            self._refresh()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)


class PreallocatedCache(DynamicCache):
    """A DynamicCache whose layers are `PreallocatedLayer`s (full-attention decoders only)."""

    def __init__(self, num_layers: int, extra_tokens: int):
        Cache.__init__(self, layers=[PreallocatedLayer(extra_tokens) for _ in range(num_layers)])


def new_decode_cache(model: torch.nn.Module, max_new_tokens: int) -> Cache | None:
    """A PreallocatedCache for `model`, or None (let the model build its own cache) when the model
    has layers that are not plain full attention (sliding windows, linear attention, ...)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    try:
        layers = DynamicCache(config=config).layers
    except Exception:  # noqa: BLE001 - an unusual config: fall back to the model's own cache
        return None
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return None
    return PreallocatedCache(len(layers), max_new_tokens)
