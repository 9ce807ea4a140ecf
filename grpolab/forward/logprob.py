"""`LogProbForward`: the one object that turns rollout rows into per-token log-probs.

Built once at setup from the config (layout, compute dtype, compilation, chunk size), it serves
Phase B's microbatches (`__call__`, with grad) and Phase A's π_old and π_ref passes
(`rollout_logprobs`, no grad), and says how a pass is chunked (`chunks`) and how Phase B
shuffles rows (`row_order`). It holds no model: each call names the model (the policy, its
compiled wrapper from `prepare`, or the reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpolab.forward.attention import autocast, require_sdpa
from grpolab.forward.buckets import group_rows
from grpolab.forward.compiled import training_module
from grpolab.forward.layouts import Layout, layout_for
from grpolab.memory import release_free_memory
from grpolab.batch import Rollout


@dataclass(frozen=True)
class LogProbForward:
    layout: Layout
    """How a batch goes through the model (`forward.layouts.LAYOUTS`)."""
    temperature: float = 1.0
    """The sampling temperature: log-probs are of logits / temperature."""
    compute_dtype: torch.dtype | None = None
    """None (float32) or torch.bfloat16 (autocast; master weights stay float32)."""
    chunk_rows: int = 32
    """Rows per chunk of a no-grad pass over a rollout (train.microbatch_size)."""
    compile: bool = False
    """`prepare` returns a torch.compile'd module (model.compile)."""
    compile_scope: str = "blocks"
    """'blocks' (each decoder layer) or 'model' (model.compile_scope)."""
    compile_cpp_wrapper: bool = False
    """inductor's C++ wrapper (model.compile_cpp_wrapper)."""

    @classmethod
    def from_config(cls, cfg, compute_dtype: torch.dtype | None) -> "LogProbForward":
        """The forward of a Config: model.padding_free / shared_prompt / compile*, rollout.temperature,
        train.microbatch_size."""
        m = cfg.model
        return cls(layout_for(m.padding_free, m.shared_prompt), cfg.rollout.temperature, compute_dtype,
                   cfg.train.microbatch_size, m.compile, m.compile_scope, m.compile_cpp_wrapper)

    def prepare(self, model: torch.nn.Module):
        """Readies `model` for this forward and returns what to call: `model` itself, or its compiled
        wrapper (same parameters). Layouts other than padded rows switch the model to grpolab's
        attention now (ValueError naming the config switch when it does not run SDPA), before any
        rollout traces a compiled decode step."""
        if self.layout.option is not None:
            require_sdpa(model, self.layout.option)
        return training_module(model, self.compile, self.compile_cpp_wrapper, self.compile_scope)

    def __call__(self, model, rows: Rollout, with_entropy: bool = False,
                 entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropies) of `rows`' completion tokens under `model`.

        Returns (logp [n, Lc'] float32, entropy [n, Lc'] or None), Lc' = rows.loss_mask.shape[1];
        0 on padded columns in the padding-free layouts. The entropy is detached unless
        `entropy_grad`. Batches must be whole groups in the shared-prompt layouts.
        """
        return self.layout.logprobs(model, rows.input_ids, rows.attention_mask, rows.prompt_len, rows.group_size,
                                    self.temperature, with_entropy, self.compute_dtype, entropy_grad)

    def chunks(self, rows: Rollout, chunk_rows: int) -> list[torch.Tensor]:
        """Row indices of `rows` in chunks of `chunk_rows` (the layout's chunking: rows of similar
        length, or about equal real tokens padding-free; whole groups with a shared prompt)."""
        return self.layout.chunks(rows, chunk_rows)

    def row_order(self, num_rows: int, group_size: int, generator: torch.Generator) -> torch.Tensor:
        """Phase B's shuffle of a step's rows: a random permutation [num_rows], of whole groups
        (each group's rows together and in order) when the layout forwards whole groups."""
        if self.layout.whole_groups:
            return group_rows(torch.randperm(num_rows // group_size, generator=generator), group_size)
        return torch.randperm(num_rows, generator=generator)

    @torch.no_grad()
    def rollout_logprobs(self, model, rollout: Rollout) -> torch.Tensor:
        """No-grad log-probs of every completion token of `rollout`, in chunks of `chunk_rows`.

        Returns [N, Lc] float32 aligned with rollout.loss_mask (0 beyond each chunk's trimmed width).
        """
        n, lc = rollout.loss_mask.shape
        out = torch.zeros(n, lc, dtype=torch.float32, device=rollout.loss_mask.device)
        with autocast(self.compute_dtype, str(rollout.input_ids.device)):  # weights cast once, not per chunk
            for idx in self.chunks(rollout, self.chunk_rows):
                lp, _ = self(model, rollout.select(idx))
                out[idx, : lp.shape[1]] = lp.float().to(out.device)
        if out.device.type == "cpu":
            release_free_memory()
        return out


def batched_logprobs(model, rollout: Rollout, temperature: float, batch_size: int, compute_dtype=None,
                     padding_free: bool = False, shared_prompt: bool = False) -> torch.Tensor:
    """`LogProbForward.rollout_logprobs` of a one-off forward in the layout of the two switches."""
    fwd = LogProbForward(layout_for(padding_free, shared_prompt), temperature, compute_dtype, batch_size)
    return fwd.rollout_logprobs(model, rollout)
