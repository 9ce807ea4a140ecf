"""A compiled decode loop (`rollout.compile`): static KV cache, one torch.compile'd decode step.

The default loop (rollout/hf.py) is eager and shrinks its batch as rows finish. On a small model a
decode step is mostly overhead: Python and many small kernels, a cost that does not shrink with the
batch. This loop gives every decode step the same shapes, so torch.compile turns it into one graph:
- the KV cache is transformers' `StaticCache`, sized for the prompt (its width rounded up to a
  multiple of `PROMPT_BUCKET`, padded on the left) plus `max_new_tokens`;
- the attention mask has that full width from the start (the columns not yet written are 0);
- finished rows are not dropped: they keep decoding, and their tokens are discarded (pad, log-prob
  0), exactly as the default loop leaves them.
The compiled step depends only on (rows, prompt bucket): one compilation per pair, which takes
longer the larger the model, so it pays over a run of fixed-size rollouts of a small,
overhead-bound model. A larger model's decode step is dominated by its matrix products, which
compilation does not speed up, and finished rows keep costing compute: the loop gains little
there, so it is off by default.

Under bf16 on a CPU the step's attention is `forward.attention.decode_attention` (float32 tensor ops
the compiler fuses) instead of PyTorch's SDPA kernel, which is slow for one query row.

Numerics: the same model forward, fused by the compiler; greedy tokens equal the eager loop's and
log-probs agree to float rounding (tests/rollout/test_static.py). The prefill runs eagerly.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import StaticCache

PROMPT_BUCKET = 16
"""Prompt widths are rounded up to a multiple of this, so that batches of nearby prompt lengths
share one compiled graph."""


def prompt_width(width: int) -> int:
    """The static cache's prompt columns for prompts `width` wide: rounded up to PROMPT_BUCKET."""
    return -(-width // PROMPT_BUCKET) * PROMPT_BUCKET


_COMPILED_FOR: set[tuple] = set()


def compiles_now(key: tuple) -> bool:
    """True the first time this process decodes with the compiled step for `key` (rows, cache
    width, compute dtype, ...: what the step's graph is specialized on), i.e. for the rollout that
    compiles it. Dynamo's tracing state keeps the compiling call's arguments, the static cache
    among them, in reference cycles that only a full garbage collection frees, and Python runs one
    rarely after the many long-lived objects a compilation creates: the static cache would stay
    alive for the rest of the run. The engine collects after such a rollout."""
    new = key not in _COMPILED_FOR
    _COMPILED_FOR.add(key)
    return new


class GroupStaticCache(StaticCache):
    """transformers' StaticCache plus the one operation the engine's prefill needs of every cache:
    `batch_repeat_interleave` (StaticLayer has none of its own)."""

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeats each filled row `repeats` times (row i -> rows i·r .. i·r + r - 1): a prompt's
        prefill shared by the G samples of its group."""
        for layer in self.layers:
            layer.keys = layer.keys.repeat_interleave(repeats, dim=0)
            layer.values = layer.values.repeat_interleave(repeats, dim=0)
            layer.batch_size = layer.keys.shape[0]


def new_static_cache(model: torch.nn.Module, max_cache_len: int) -> GroupStaticCache | None:
    """A GroupStaticCache for `model`, or None when its config does not give one."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    try:
        return GroupStaticCache(config=config, max_cache_len=max_cache_len)
    except Exception:  # noqa: BLE001 - an unusual config: the caller falls back to the eager loop
        return None


def _decode_step(model, cache_kwarg: str, cache, tokens, attention_mask, positions):
    """One decode step: logits [N, V] (fp32) of the next token. tokens, positions: [N, 1];
    attention_mask: [N, L] over the whole static cache."""
    out = model(input_ids=tokens, attention_mask=attention_mask, position_ids=positions,
                use_cache=True, logits_to_keep=1, **{cache_kwarg: cache})
    return out.logits[:, -1].float()


REALIZE_OPCOUNT = 8
"""Inductor's `realize_opcount_threshold` for the decode step. A pointwise result whose formula
has more ops than this is computed once into a buffer instead of being recomputed inside each
loop that reads it. The CPU default (50) leaves the rotary embedding (a cos and a sin per
element) inlined in the attention's loop over the cache, recomputed once per cached position;
at 8 it is computed once per step into a buffer that the attention's loop reads."""

_compiled_step = None


def compiled_step():
    """The torch.compile'd `_decode_step` (static shapes), built on first use."""
    global _compiled_step
    if _compiled_step is None:
        _compiled_step = torch.compile(_decode_step, dynamic=False,
                                       options={"realize_opcount_threshold": REALIZE_OPCOUNT})
    return _compiled_step
