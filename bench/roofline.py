"""How close a grpolab step comes to this CPU's measured GEMM peak, phase by phase.

    python bench/roofline.py                              # tiny fixture, bf16, peak in fp32 and bf16
    python bench/roofline.py --dtype float32              # a CPU without native bf16: fp32 peak only
    python bench/roofline.py --model smollm2 --prompts 4 --microbatch 32 --steps 2 --lr 1e-5 --padding-free
    python bench/roofline.py --dtype float32 --compile --compile-scope model --compile-decode --cpp-wrapper --shared-prompt --keep-freed-memory --warmup 2
                                                          # vs_trl.py's float32 grpolab side (no --grpolab- prefix)
    python bench/roofline.py --peak-only

1. Peak: the best sustained rate of large GEMMs (`--gemm` = M = N = K; 20 timings of 5 back-to-back
   calls) per dtype, with the same thread count as the run; that is the "machine limit" the phases
   are compared with.
2. Model FLOPs of one step, counted from the model config and the step's real token counts
   (matmul FLOPs only; padding and recomputation are not counted, so these are useful FLOPs):
   - decoder: 2 FLOPs per non-embedding matmul weight per token, plus attention 4·layers·hidden·ctx;
   - LM head: 2·hidden·vocab per position whose logits are computed;
   - generation: each prompt prefilled once (grpolab shares it among its G samples), then one
     decoder pass + LM head per generated token, at its context length;
   - reference forward (and a π_old forward, which the bench's one minibatch per epoch never
     needs): every row, LM head on the completion positions only; with `--shared-prompt` each
     group's prompt once, as that forward computes it;
   - training: forward + backward = 3 × the forward, μ times.
3. Each phase's FLOP/s over its measured time, as a fraction of the peak of the compute dtype:
   "of peak" against the peak measured once before the run; "of local" against the mean of two
   shorter peak measurements (`--bracket-repeats` timings) taken right before and right after the
   phase's step (median over the timed steps). A shared VM's GEMM rate can change within minutes
   (neighbours, clock and power states), so a phase is also compared with the machine's state while
   it ran.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    Workload,
    add_grpolab_flags,
    cpu_description,
    grpolab_options,
    load_tokenizer,
    model_dir,
    prompt_set,
    set_threads,
)

PHASES = ("generate", "logprob", "learn")  # the phases with model FLOPs (scoring has none)


def gemm_peak(dtype, size: int = 2048, repeats: int = 20, group: int = 5) -> float:
    """Best sustained FLOP/s of a size³ matmul in `dtype` (a plain torch.mm, as a model's linear
    layers use): the best of `repeats` timings of `group` back-to-back calls.
    Many timings, because the best of a few moves from run to run with the machine's state; groups
    of calls per timing, because a single call timed alone can read well above the rate the machine
    sustains (a short burst of a higher clock), so the best single call would measure the clock,
    not the machine."""
    import torch

    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.mm(a, b)  # warm-up (kernel selection, AMX tile config)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(group):
            torch.mm(a, b)
        best = min(best, (time.perf_counter() - t) / group)
    return 2 * size**3 / best


def model_shape(path: Path) -> dict:
    """Sizes the FLOP count needs, from config.json: layers, hidden, vocab, decoder matmul weights."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(path, local_files_only=True)
    h, layers, inter = c.hidden_size, c.num_hidden_layers, c.intermediate_size
    heads, kv = c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or h // heads
    attn = h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h  # q, k, v, o
    mlp = 3 * h * inter  # gate, up, down (SwiGLU)
    return {"layers": layers, "hidden": h, "vocab": c.vocab_size, "decoder_weights": layers * (attn + mlp),
            "attn_width": heads * head_dim}


def forward_flops(shape: dict, tokens: float, ctx: float, head_positions: float) -> float:
    """Forward FLOPs of `tokens` tokens at mean context `ctx`, LM head on `head_positions` positions."""
    per_token = 2 * shape["decoder_weights"] + 4 * shape["layers"] * shape["attn_width"] * ctx
    return tokens * per_token + head_positions * 2 * shape["hidden"] * shape["vocab"]


def step_flops(shape: dict, w: Workload, prompt_len: float, comp_len: float,
               shared_prompt: bool | None = None) -> dict[str, float]:
    """FLOPs of the phases of one step, with mean prompt / completion lengths in tokens. The prompts
    are prefilled once per group; the log-prob passes compute them once per group too with
    `shared_prompt` (default: the workload's `grpolab_shared_prompt`; pass what the run decided), else
    once per row. Splitting a pass into prompt and completion tokens
    leaves its attention FLOPs as at the mean context (prompt + completion) / 2."""
    n, p = w.sequences_per_step, w.prompts_per_step
    prefill = forward_flops(shape, p * prompt_len, prompt_len / 2, p)
    decode = forward_flops(shape, n * comp_len, prompt_len + comp_len / 2, n * comp_len)
    prompt_rows = p if (w.grpolab_shared_prompt if shared_prompt is None else shared_prompt) else n
    one_pass = (forward_flops(shape, prompt_rows * prompt_len, prompt_len / 2, 0)
                + forward_flops(shape, n * comp_len, prompt_len + comp_len / 2, n * comp_len))
    # a Workload's optimizer step covers the whole batch (one minibatch per epoch), so grpolab runs no
    # π_old pass (epoch 0's training forward records it): the no-grad passes are the reference's
    passes = 1 if w.beta > 0 else 0
    return {"generate": prefill + decode, "logprob": passes * one_pass, "learn": 3 * w.epochs * one_pass}


def run(args) -> None:
    import torch

    set_threads(args.threads)
    from grpolab.hardware import cpu_supports_bf16

    # Without native bf16 (e.g. an AVX2-only CPU) torch emulates it, far slower than float32: a large
    # bf16 GEMM then takes very long, so its peak is measured only where it is native or the run uses it.
    dtypes = ("float32", "bfloat16") if cpu_supports_bf16() or args.dtype == "bfloat16" else ("float32",)
    peaks = {name: gemm_peak(getattr(torch, name), args.gemm) for name in dtypes}
    print(f"CPU: {cpu_description()}")
    print(f"GEMM peak ({args.gemm}³, {torch.get_num_threads()} threads): "
          + ", ".join(f"{name} {peak / 1e9:.0f} GFLOP/s" for name, peak in peaks.items())
          + ("" if "bfloat16" in peaks else " (bf16 not measured: this CPU has no native bf16)"))
    if args.peak_only:
        return
    from vs_trl import run_grpolab

    w = Workload(model=args.model, prompts_per_step=args.prompts, microbatch_size=args.microbatch,
                 dtype=args.dtype, max_new_tokens=args.max_new_tokens, epochs=args.epochs, beta=args.beta,
                 lr=args.lr, **grpolab_options(args))
    path = model_dir(w.model)
    tok = load_tokenizer(path)
    prompts = [p["prompt"] for p in prompt_set(model=w.model)]
    prompt_len = statistics.mean(len(ids) for ids in tok(prompts, add_special_tokens=False)["input_ids"])
    shape = model_shape(path)
    dtype = getattr(torch, w.dtype)
    local = []  # the peak again before the first step and after each step: the machine state around each phase
    res = run_grpolab(w, args.steps, args.warmup,
                      between_steps=lambda: local.append(gemm_peak(dtype, args.gemm, repeats=args.bracket_repeats)))
    timed = res["steps"][res["warmup"]:]
    brackets = [(local[i] + local[i + 1]) / 2 for i in range(res["warmup"], len(res["steps"]))]
    peak = peaks[w.dtype]
    ran = res["speed"]  # the settings as the run decided them (grpolab's auto switches included)
    mode = "".join(f" {k.split('.')[1].replace('_', '-')}" for k, v in ran.items() if v is True)
    mode += f" (compile scope: {ran['model.compile_scope']})" if ran["model.compile"] else ""
    print(f"{w.model} {w.dtype}{mode}: P={w.prompts_per_step} G={w.group_size} mean prompt {prompt_len:.1f} tokens")
    print(f"{w.dtype} peak around each timed step (mean of the measurements before and after it): "
          + ", ".join(f"{b / 1e9:.0f}" for b in brackets) + " GFLOP/s")
    print(f"{'phase':9} {'s':>7} {'GFLOP':>8} {'GFLOP/s':>8} {'of peak':>8} {'of local':>8}")
    comp_lens = [r["gen_tokens"] / w.sequences_per_step for r in timed]
    shared = ran["model.shared_prompt"]
    flops = {name: [step_flops(shape, w, prompt_len, c, shared)[name] for c in comp_lens] for name in PHASES}
    secs = {name: [r[name] for r in timed] for name in PHASES}
    flops["step"] = [sum(per_step) for per_step in zip(*(flops[name] for name in PHASES))]
    secs["step"] = [sum(per_step) for per_step in zip(*(secs[name] for name in PHASES))]
    for name in (*PHASES, "step"):
        f, t = statistics.median(flops[name]), statistics.median(secs[name])
        of_local = statistics.median(x / y / b for x, y, b in zip(flops[name], secs[name], brackets))
        print(f"{name:9} {t:7.3f} {f / 1e9:8.1f} {f / t / 1e9:8.1f} {f / t / peak:8.1%} {of_local:8.1%}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--microbatch", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--lr", type=float, default=1e-4, help="use 1e-5 for smollm2, as vs_trl.py's SmolLM2 command")
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="0 = torch's default")
    p.add_argument("--gemm", type=int, default=2048, help="M = N = K of the peak GEMM")
    p.add_argument("--peak-only", action="store_true")
    p.add_argument("--bracket-repeats", type=int, default=8,
                   help="timings of the peak measured before and after each step ('of local')")
    add_grpolab_flags(p, "")  # --compile, --compile-scope, --padding-free, ...: as vs_trl.py's --grpolab-*
    return p.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())
