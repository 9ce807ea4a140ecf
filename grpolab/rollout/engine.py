"""The `Engine` protocol: what Phase A asks of a generation engine, and the registry of engines.

The loop knows only this protocol. An engine generates G completions per prompt and hands back
a `Rollout` (prompt | completion ids, masks, truncation flags, its own sampler log-probs); turns a
Rollout's completions into text; and takes the trainer's new weights after each optimizer phase
(`load_weights`), keeping the version they carry. The in-process HF engine samples from the live
policy, so a load there only records the version; engines with weights of their own (a vLLM
server, Ray rollout workers) copy them.

`rollout.engine` names an entry of `ENGINES`; config validation reads its keys.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Callable, Protocol, runtime_checkable

import torch

from grpolab.batch import Rollout


@runtime_checkable
class Engine(Protocol):
    weight_version: int
    """The version of the weights the engine samples from (0 = the initial policy)."""

    def generate(self, prompts: Sequence[str], group_size: int, *, generator: torch.Generator | None = None,
                 greedy: bool = False) -> Rollout:
        """G = group_size completions for each prompt: a Rollout of len(prompts) × G rows, grouped by prompt."""
        ...

    def decode(self, rollout: Rollout) -> list[str]:
        """The completion texts of a Rollout, cut at the first EOS (EOS not included)."""
        ...

    def load_weights(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        """Samples from `state` (the policy's state dict) from now on; `version` counts optimizer phases."""
        ...


EngineFactory = Callable[..., Engine]
"""(cfg: Config, policy, tokenizer, compute_dtype) -> Engine."""


def _hf_engine(cfg, policy, tokenizer, compute_dtype) -> Engine:
    """Hugging Face model in the training process, sampling from the policy itself (CPU or GPU)."""
    from grpolab.rollout.hf import HFEngine

    r = cfg.rollout
    return HFEngine(tokenizer, r.max_new_tokens, r.temperature, r.top_p, r.top_k, compute_dtype, compile=r.compile,
                    bf16_weights=r.bf16_weights, packed_weights=r.packed_weights, model=policy)


def _vllm_engine(cfg, policy, tokenizer, compute_dtype) -> Engine:
    """vLLM on a CUDA GPU (the vllm extra) with its own copy of the weights, loaded after each optimizer
    phase. It runs in the training process or in a rollout worker, and sleeps while the trainer learns
    (rollout.vllm_sleep)."""
    from grpolab.rollout.vllm_engine import VLLMEngine  # vllm itself is imported only when the engine is built

    return VLLMEngine.from_config(cfg, policy, tokenizer, compute_dtype)


ENGINES: dict[str, EngineFactory] = {
    "hf": _hf_engine,
    "vllm": _vllm_engine,
}
"""rollout.engine -> factory. The HF engine runs in the training process on the policy itself; the vLLM
engine (CUDA only) holds weights of its own, refreshed by `load_weights`."""


def build_engine(cfg, policy, tokenizer, compute_dtype) -> Engine:
    """The engine that `cfg.rollout.engine` names, sampling from `policy`."""
    if cfg.rollout.engine not in ENGINES:
        raise ValueError(f"rollout.engine={cfg.rollout.engine!r} is not one of {', '.join(ENGINES)}")
    return ENGINES[cfg.rollout.engine](cfg, policy, tokenizer, compute_dtype)
