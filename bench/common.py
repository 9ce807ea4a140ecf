"""The shared fixture of the speed benches: one model, one prompt set, one reward, one workload.

Both frameworks get exactly the same inputs:
- model: a folder on disk (config.json + safetensors + tokenizer), so that TRL can build its
  reference model from the path like it does for any hub model. The tiny fixture is a seeded
  Qwen2 (hidden 256, 4 layers, SwiGLU 768) over a 128-symbol character vocabulary (~3.4M params),
  built once and cached under ~/.cache/grpolab/bench/; the SmolLM2 variant is the converted
  SmolLM2-135M-Instruct folder of `grpolab.models.loading`.
- prompts: training-side arithmetic prompts of the built-in task ("07+45="), a fixed list.
- reward: `digit_reward`, a dense score a random-init model can climb (share of digit characters
  in the completion, +1 for the exact answer), so the training curves of the two sides can be
  compared from step 0 without an SFT stage.
- workload: `Workload` (P prompts × G completions per step, max completion length, μ epochs,
  β, learning rate, seed, microbatch × accumulation = one optimizer step over the whole batch).

Units: one "step" is one generation round (P × G completions) followed by μ optimizer steps over
it, for both frameworks (TRL counts optimizer steps: its max_steps is μ × ours).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_CACHE = Path(os.environ.get("GRPOLAB_CACHE", Path.home() / ".cache" / "grpolab")) / "bench"
TINY_VOCAB = 128
TINY_SPEC = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "max_positions": 64, "seed": 0}


@dataclass(frozen=True)
class Workload:
    """One training step of the comparison, identical on both sides."""

    model: str = "tiny"
    """'tiny' (the char-level Qwen2 fixture) or 'smollm2' (SmolLM2-135M-Instruct)."""
    prompts_per_step: int = 16
    group_size: int = 8
    max_new_tokens: int = 32
    epochs: int = 2
    """μ: optimizer passes over each generation batch (TRL's num_iterations)."""
    beta: float = 0.04
    """KL coefficient (k3, not ratio-weighted: TRL's default); > 0 loads a reference model."""
    lr: float = 1e-4
    microbatch_size: int = 32
    seed: int = 0
    dtype: str = "float32"
    """float32 | bfloat16 (autocast on both sides; master weights fp32)."""
    temperature: float = 1.0
    grpolab_compile: bool | None = None
    """grpolab side only: model.compile (torch.compile of the training and no-grad log-prob forwards).
    None, like every grpolab_* switch: grpolab's default (auto, decided at setup)."""
    grpolab_compile_scope: str | None = None
    """grpolab side only, with grpolab_compile: model.compile_scope ('blocks' or 'model')."""
    grpolab_compile_decode: bool | None = None
    """grpolab side only: rollout.compile (static KV cache, torch.compile'd decode step)."""
    grpolab_cpp_wrapper: bool | None = None
    """grpolab side only, with grpolab_compile: model.compile_cpp_wrapper (inductor's C++ wrapper)."""
    grpolab_bf16_weights: bool | None = None
    """grpolab side only, bfloat16: rollout.bf16_weights (sample from a per-rollout bf16 weight copy)."""
    grpolab_padding_free: bool | None = None
    """grpolab side only: model.padding_free (log-prob forwards pack the real tokens)."""
    grpolab_shared_prompt: bool | None = None
    """grpolab side only: model.shared_prompt (log-prob forwards compute each group's prompt once)."""
    grpolab_packed_weights: bool | None = None
    """grpolab side only, float32: rollout.packed_weights (the eager decode on oneDNN-packed weights)."""
    grpolab_keep_freed_memory: bool | None = None
    """grpolab side only: train.keep_freed_memory (no heap trims between phases; more peak RSS)."""
    trl_compile: bool | None = None
    """TRL side only: TrainingArguments.torch_compile (None: TRL's default, off)."""
    trl_gradient_checkpointing: bool | None = None
    """TRL side only: gradient_checkpointing (None: TRL's default, on: the backward recomputes the forward)."""

    @property
    def sequences_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def accumulation(self) -> int:
        """Microbatches per optimizer step (one optimizer step covers the whole batch)."""
        if self.sequences_per_step % self.microbatch_size:
            raise ValueError(f"microbatch_size={self.microbatch_size} must divide P×G={self.sequences_per_step}")
        return self.sequences_per_step // self.microbatch_size

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def from_json(text: str) -> Workload:
        return Workload(**json.loads(text))


GRPOLAB_OPTIONS: dict[str, tuple[str, str]] = {
    "compile": ("model.compile", "torch.compile of the log-prob forwards; the first step compiles"),
    "compile_scope": ("model.compile_scope", "with compile: the transformer blocks, or the whole model as one graph"),
    "compile_decode": ("rollout.compile", "static KV cache, compiled decode step"),
    "cpp_wrapper": ("model.compile_cpp_wrapper", "with compile; small models only"),
    "bf16_weights": ("rollout.bf16_weights", "bfloat16 runs: a bf16 weight copy for sampling"),
    "padding_free": ("model.padding_free", "the log-prob forwards compute only real tokens"),
    "shared_prompt": ("model.shared_prompt", "the log-prob forwards compute each group's prompt once"),
    "packed_weights": ("rollout.packed_weights", "float32 runs without compile-decode: the decode's linear layers "
                       "on oneDNN-packed weights"),
    "keep_freed_memory": ("train.keep_freed_memory", "no heap trims between phases"),
}
"""The grpolab side's settings of a Workload (its fields `grpolab_<name>`): the config field each sets, and
its command-line help."""


def add_grpolab_flags(parser, prefix: str, help_prefix: str = "") -> None:
    """One option per GRPOLAB_OPTIONS entry, `--<prefix><name>` / `--no-<prefix><name>` (underscores as
    dashes; absent: grpolab's default), stored as the Workload field's name: the benches take the same
    grpolab settings (`grpolab_options`)."""
    import argparse

    for name, (field_name, help_text) in GRPOLAB_OPTIONS.items():
        flag, dest = "--" + prefix + name.replace("_", "-"), "grpolab_" + name
        text = f"{field_name} ({help_text})"
        if name == "compile_scope":  # the one setting that is not a switch
            parser.add_argument(flag, dest=dest, choices=("blocks", "model"), default=None, help=help_prefix + text)
        else:
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None,
                                help=help_prefix + text)


def grpolab_options(args) -> dict[str, Any]:
    """The Workload fields of the options `add_grpolab_flags` added to `args`' parser."""
    return {"grpolab_" + name: getattr(args, "grpolab_" + name) for name in GRPOLAB_OPTIONS}


# --------------------------------------------------------------------------- model folders


def tiny_extra_chars(vocab_size: int = TINY_VOCAB) -> str:
    """Characters appended to the char tokenizer's alphabet so that its vocabulary has `vocab_size` ids."""
    from grpolab.models.tiny import SPECIAL_TOKENS, WORDS, char_alphabet

    base = set(char_alphabet())
    need = vocab_size - len(SPECIAL_TOKENS) - len(WORDS) - len(base)  # the word tokens count too
    pool = [chr(c) for c in range(0x21, 0x7F)] + [chr(c) for c in range(0xC0, 0x250)]
    extra = [ch for ch in pool if ch not in base][:need]
    if len(extra) < need:
        raise ValueError(f"tiny_extra_chars: cannot reach a vocabulary of {vocab_size}")
    return "".join(extra)


def tiny_fixture_dir() -> Path:
    """The tiny fixture folder (built and saved on first use; keyed by its spec)."""
    key = hashlib.sha256(json.dumps({**TINY_SPEC, "vocab": TINY_VOCAB}, sort_keys=True).encode()).hexdigest()[:12]
    path = BENCH_CACHE / f"tiny-{key}"
    if (path / "config.json").is_file():
        return path
    from grpolab.models.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer(tiny_extra_chars())
    assert len(tok) == TINY_VOCAB, len(tok)
    model = build_tiny_model(tok, **TINY_SPEC)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(path)
    return path


def model_dir(name: str) -> Path:
    if name == "tiny":
        return tiny_fixture_dir()
    if name == "smollm2":
        from grpolab.models.loading import resolve_model_path

        return resolve_model_path("smollm2-135m-instruct")
    raise ValueError(f"model must be 'tiny' or 'smollm2', got {name!r}")


def import_model_code(path: Path) -> None:
    """Imports transformers' modeling code of the model at `path` (transformers imports it lazily, on
    the first load: about 2 s, paid by whichever side loads first); the benches call it on both sides
    before their clocks start, with the other framework imports."""
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained(path, local_files_only=True))]


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


# --------------------------------------------------------------------------- prompts and reward


def prompt_set(n: int = 512, seed: int = 0, model: str = "tiny") -> list[dict[str, Any]]:
    """n arithmetic prompts (training side of the built-in task): [{'prompt', 'answer'}].

    The SmolLM2 variant asks in words ("Compute 07+45. Answer: ") so that the model's
    completions are ordinary text; the tiny fixture gets the bare "07+45=".
    """
    from grpolab.data.arith import ArithTask

    task = ArithTask(seed=0, ops="+-", unanswerable_share=0.0)
    items = task.train_prompts(random.Random(seed), n)
    fmt = (lambda p: f"Compute {p[:-1]}. Answer: ") if model == "smollm2" else (lambda p: p)
    return [{"prompt": fmt(it.prompt), "answer": str(it.meta["answer"])} for it in items]


def digit_reward(completion: str, answer: str) -> float:
    """Share of digit characters in the completion, +1 when its first number is the answer."""
    text = completion.strip()
    if not text:
        return 0.0
    share = sum(ch.isdigit() for ch in text) / len(text)
    first = text.split()[0] if text.split() else ""
    return share + (1.0 if first.rstrip(".") == answer else 0.0)


def digit_rewards(completions: Sequence[str], answers: Sequence[str]) -> list[float]:
    return [digit_reward(c, a) for c, a in zip(completions, answers)]


# --------------------------------------------------------------------------- measurement helpers


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, MB."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_description(cpuinfo: str | None = None) -> str:
    """The CPU model, the bf16 matrix instructions it has and its widest vector unit (Linux
    /proc/cpuinfo), e.g. "AMD EPYC (avx512_bf16; avx512f)". The GEMM peaks, and so every "fraction of
    peak", depend on them: AMX runs bf16 products fastest, AVX512-BF16 next; without either, torch
    emulates bf16, far slower than the float32 the CPU's vector units run natively."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            import platform

            return platform.processor() or "unknown CPU"
    pairs = (line.split(":", 1) for line in cpuinfo.splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in pairs}  # the last CPU's
    flags = set(fields.get("flags", "").split())
    bf16 = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
    simd = next((f for f in ("avx512f", "avx2") if f in flags), "")  # the widest fp32 vector unit
    return (f"{fields.get('model name', 'unknown CPU')} ({', '.join(bf16) or 'no bf16 matrix instructions'}"
            f"{'; ' + simd if simd else ''})")


def set_threads(n: int) -> None:
    import torch

    if n > 0:
        torch.set_num_threads(n)
        torch.set_num_interop_threads(1)
