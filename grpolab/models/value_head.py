"""A scalar value head on the policy's trunk (PPO's critic, sharing the policy's transformer).

V(s_t) = w · h_t + b, h_t the trunk's last hidden state (after its final norm: the LM head's
input) at the position that predicts completion token t, as TRL's value-head models and its
PPOTrainer read it (`values[:, context_length - 1 : -1]`). The policy stays a plain transformers
model: the head is a module of its own (saved beside the policy's weights), and Phase B reads
h from the policy's own training forward through a forward hook on the trunk, so the value loss
costs no second forward. Only the padded-rows layout is supported (config validation).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from grpolab.forward.attention import autocast
from grpolab.batch import Rollout, position_ids


class ValueHead(nn.Module):
    """Linear(hidden_size -> 1), zero-initialised: V = 0 at the start, so the first value-loss
    gradients reach the head alone (w = 0 passes none to the trunk). Computes in its weights' dtype
    (float32), also under a bf16 autocast."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> values [...] in the head's dtype."""
        with torch.autocast(hidden.device.type, enabled=False):
            return self.linear(hidden.to(self.linear.weight.dtype)).squeeze(-1)


def decoder_of(model: nn.Module) -> nn.Module:
    """The transformer trunk of a causal LM: its `get_decoder()` (of the base model under PEFT),
    whose output's last_hidden_state is what the LM head reads. ValueError for other models."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    get = getattr(base, "get_decoder", None)
    decoder = get() if callable(get) else None
    if not isinstance(decoder, nn.Module) or decoder is base:
        raise ValueError(f"loss.advantage=gae puts a value head on the policy's trunk, but {type(base).__name__} "
                         "has no get_decoder() returning it; use a transformers causal LM")
    return decoder


def completion_values(head: ValueHead, hidden: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """V at the positions that predict completion tokens: hidden [n, T, H] of rows whose completion
    starts at column prompt_len -> [n, T - prompt_len] float32."""
    return head(hidden[:, prompt_len - 1 : -1])


@contextlib.contextmanager
def captured_hidden(decoder: nn.Module):
    """Within the block, every forward of `decoder` appends its last hidden state [n, T, H] (with
    its graph) to the yielded list; the hook is removed on exit."""
    seen: list[torch.Tensor] = []

    def hook(module, args, output):
        seen.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    handle = decoder.register_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


@torch.no_grad()
def rollout_values(head: ValueHead, decoder: nn.Module, rollout: Rollout, chunks: list[torch.Tensor],
                   compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Phase A's no-grad pass: V_old of every completion token, the trunk alone (no LM head) run
    over the rows in `chunks` (row indices, e.g. `LogProbForward.chunks`).

    Returns [N, Lc] in the head's dtype (float32) aligned with rollout.loss_mask (0 beyond each
    chunk's trimmed width).
    """
    n, lc = rollout.loss_mask.shape
    out = torch.zeros(n, lc, dtype=head.linear.weight.dtype, device=rollout.loss_mask.device)
    with autocast(compute_dtype, str(rollout.input_ids.device)):
        for idx in chunks:
            rows = rollout.select(idx)
            am = rows.attention_mask
            hidden = decoder(input_ids=rows.input_ids, attention_mask=am.long(), position_ids=position_ids(am),
                             use_cache=False).last_hidden_state
            v = completion_values(head, hidden, rows.prompt_len)
            out[idx, : v.shape[1]] = v.to(out.device)
    return out
