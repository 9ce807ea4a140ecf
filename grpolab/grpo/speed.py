"""The speed switches a config leaves at `auto`, decided once at setup.

Seven config switches change how fast a step runs, never what it computes beyond rounding:
model.padding_free, model.shared_prompt, model.compile, rollout.compile, rollout.bf16_weights,
rollout.packed_weights and train.keep_freed_memory. Each defaults to `auto`; `resolve_speed`
turns every `auto` into on or off from the model (its width, its attention), the sequence lengths,
the batch geometry, the compute dtype and the device, and says why in one line that setup prints.
An explicit true / false is kept as it is.

The rules (measured in bench/vs_trl.py; bench/README.md has the figures per host kind):
- shared_prompt: on a CPU when every optimizer step takes the whole batch (one minibatch per epoch,
  so drawing whole groups instead of rows changes nothing) and microbatches can be whole groups;
- padding_free: on a CPU in bf16; in float32 where rows (data.max_prompt_tokens +
  rollout.max_new_tokens) are short enough for one padded attention call per layer
  (`SHORT_ATTENTION_MAX_TOKENS`), or for models at least `WIDE_MODEL_HIDDEN` wide (elsewhere the
  per-row attention of a narrow model costs more than the padding it saves);
- packed_weights: float32 eager decode on a CPU, models at least `WIDE_MODEL_HIDDEN` wide;
- keep_freed_memory: on a CPU, except under FSDP2 on several ranks (each layer's gathered
  parameters are freed after use; kept, those pages add to every rank's peak);
- model.compile and rollout.compile: only where the planned run recovers the compile time
  (`compile_pays`); bf16_weights goes with a compiled decode in bf16.
The two layouts and the compile stay off on GPUs under auto: they were not measured there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpolab.forward.attention import SHORT_ATTENTION_MAX_TOKENS
from grpolab.grpo.compile_cache import COLD_COMPILE_S

AUTO = "auto"

WIDE_MODEL_HIDDEN = 512
"""Hidden size from which float32 padding-free forwards of long rows and packed decode weights pay on a
CPU (SmolLM2-135M, 576 wide, gains; the 256-wide bench fixture does not)."""

COMPILE_GAIN = {"bfloat16": 0.3, "float32": 0.0}
"""Share of a step's time that compiling the forwards and the decode step saves on a CPU, per compute
dtype: the estimate of `compile_pays`. Measured on the bench fixture (bench/README.md): in bf16
(AVX512-BF16) the compiled switches ran a step in about 2/3 of the eager time; in float32 (AVX2)
the compiled blocks were no faster than eager (2.64-2.71 against 2.41 s per step)."""

CPU_STEP_FLOP_RATE = 100e9
"""FLOP/s `compile_pays` assumes for a CPU step (2-core VMs run the fixture's step at 60-160)."""


@dataclass(frozen=True)
class Decision:
    """One `auto` switch, decided."""

    field: str
    """The dotted config field, e.g. model.shared_prompt."""
    on: bool
    why: str
    """A few words: what the decision rests on."""


def _attention_plain(model) -> str:
    """'' when the model's attention is SDPA without a sliding window or soft cap (what the grouped and
    padding-free forwards need), else why not."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ("sdpa", "grpolab_sdpa"):
        return f"attention is {impl!r}, not SDPA"
    window = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    if window or getattr(config, "attn_logit_softcapping", None):
        return "attention uses a sliding window or a soft cap"
    return ""


def _hidden(model) -> int:
    return int(getattr(getattr(model, "config", None), "hidden_size", 0) or 0)


def _layouts(cfg, model, on_cpu: bool, bf16: bool) -> list[Decision]:
    from grpolab.algo.advantages import VALUE_BASED

    m, G, out = cfg.model, cfg.rollout.group_size, []
    common = ("GPU (not measured there)" if not on_cpu else _attention_plain(model)
              or ("a value head reads padded rows" if cfg.loss.advantage in VALUE_BASED else ""))
    if m.shared_prompt == AUTO:
        per_rank = cfg.minibatch_sequences // cfg.world_size
        why = common or ("groups of one" if G < 2 else "" if cfg.minibatches_per_epoch == 1
                         else "several minibatches per epoch are draws of rows")
        if not why and (per_rank % G or cfg.train.microbatch_size % G):
            why = f"microbatches of {cfg.train.microbatch_size} are not whole groups of {G}"
        prompt_share = f"prompt forwarded once per group of {G}"
        out.append(Decision("model.shared_prompt", not why, why or prompt_share))
    if m.padding_free == AUTO:
        longest = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
        short, wide = longest <= SHORT_ATTENTION_MAX_TOKENS, _hidden(model) >= WIDE_MODEL_HIDDEN
        why = common or ("" if bf16 or short or wide else
                         f"float32, rows up to {longest} tokens on a model {_hidden(model)} wide: per-row attention "
                         "costs more than the padding")
        said = "bf16" if bf16 else f"rows ≤ {longest} tokens: one padded attention call" if short else "wide model"
        out.append(Decision("model.padding_free", not why, why or said))
    return out


def compile_pays(cfg, model, steps: int, on_cpu: bool, bf16: bool) -> tuple[bool, str]:
    """Whether compiling the forwards (and the decode step) pays within `steps` planned steps.

    Estimate: a step's time is its matmul FLOPs (2 per weight per token: generation, one no-grad pass
    per reference / π_old forward, 3 × the forward per epoch) at `CPU_STEP_FLOP_RATE`; compiling
    saves the compute dtype's `COMPILE_GAIN` of it per step and costs `compile_cache.COLD_COMPILE_S`.
    On only where steps × saving > cost."""
    if not on_cpu:
        return False, "GPU (not measured there)"
    if cfg.model.lora_rank > 0 or cfg.world_size > 1:
        return False, "LoRA / several ranks run eager"
    gain_share = COMPILE_GAIN["bfloat16" if bf16 else "float32"]
    if not gain_share:
        return False, "float32 on a CPU: compiled forwards measured no faster than eager"
    params = sum(p.numel() for p in model.parameters())
    tokens = cfg.rollout.prompts_per_step * cfg.rollout.group_size * cfg.rollout.max_new_tokens
    passes = 1 + int(cfg.needs_reference) + int(cfg.needs_old_logp_pass) + 3 * cfg.train.epochs
    step_s = 2 * params * tokens * passes / CPU_STEP_FLOP_RATE
    cost = COLD_COMPILE_S
    gain = steps * gain_share * step_s
    verdict = gain > cost
    return verdict, (f"{steps} steps × ~{gain_share * step_s:.2f} s saved {'>' if verdict else '<'} "
                     f"~{cost:.0f} s to compile")


def decide(cfg, model, compute_dtype, steps: int) -> list[Decision]:
    """The decisions of every `auto` switch of cfg (explicit values are not listed)."""
    on_cpu = torch.device(cfg.model.device).type == "cpu"
    bf16 = compute_dtype == torch.bfloat16
    r, out = cfg.rollout, _layouts(cfg, model, on_cpu, bf16)
    compiles = None
    if cfg.model.compile == AUTO or r.compile == AUTO:
        compiles = compile_pays(cfg, model, steps, on_cpu, bf16)
    if cfg.model.compile == AUTO:
        out.append(Decision("model.compile", *compiles))
    decode_compiled = r.compile is True or (r.compile == AUTO and compiles[0] and r.engine == "hf")
    if r.compile == AUTO:
        out.append(Decision("rollout.compile", decode_compiled, compiles[1] if r.engine == "hf" else "hf engine only"))
    if r.bf16_weights == AUTO:
        on = decode_compiled and bf16
        out.append(Decision("rollout.bf16_weights", on, "bf16 compiled decode" if on else "no bf16 compiled decode"))
    if r.packed_weights == AUTO:
        why = ("GPU" if not on_cpu else "bf16" if bf16 else "compiled decode" if decode_compiled
               else "" if _hidden(model) >= WIDE_MODEL_HIDDEN else f"hidden {_hidden(model)} < {WIDE_MODEL_HIDDEN}")
        out.append(Decision("rollout.packed_weights", not why, why or f"float32 decode, hidden {_hidden(model)}"))
    if cfg.train.keep_freed_memory == AUTO:
        sharded = cfg.world_size > 1 and cfg.train.parallel == "fsdp2"
        why = "GPU" if not on_cpu else "FSDP2 frees gathered layers: kept pages raise the peak" if sharded else ""
        out.append(Decision("train.keep_freed_memory", not why, why or "CPU"))
    return out


def resolve_speed(cfg, model, compute_dtype) -> tuple:
    """(cfg with every `auto` switch set, the decisions); the run plans cfg.train.steps steps."""
    decisions = decide(cfg, model, compute_dtype, cfg.train.steps)
    return cfg.replace(**{d.field: d.on for d in decisions}), decisions


def speed_line(decisions: list[Decision]) -> str:
    """One line for the start of a run: which auto switches are on and off, and why."""
    if not decisions:
        return ""
    on = [f"{d.field} ({d.why})" for d in decisions if d.on]
    off = [f"{d.field} ({d.why})" for d in decisions if not d.on]
    return "speed (auto): on: " + (", ".join(on) or "none") + "; off: " + (", ".join(off) or "none")


def host_report(preset: str = "grpo") -> str:
    """What this host is and what `auto` decides on it for `grpolab train PRESET` (the built-in tiny
    model): the CPU line, the compute dtype, the speed line. `python -m grpolab.grpo.speed [PRESET]`."""
    from grpolab import config as C
    from grpolab.hardware import describe_cpu
    from grpolab.models.loading import resolve_dtype
    from grpolab.models.tiny import build_char_tokenizer, build_tiny_model

    cfg = C.from_preset(preset)
    model = build_tiny_model(build_char_tokenizer(), hidden_size=cfg.model.hidden_size,
                             num_layers=cfg.model.num_layers, num_heads=cfg.model.num_heads)
    dtype = resolve_dtype(cfg.model.dtype, cfg.model.device)
    line = speed_line(decide(cfg, model, None if dtype == torch.float32 else dtype, cfg.train.steps))
    return f"{describe_cpu()}\n{preset}: model.dtype={cfg.model.dtype} -> {str(dtype).removeprefix('torch.')}; {line}"


if __name__ == "__main__":
    import sys

    print(host_report(*sys.argv[1:2]))
