"""grpolab vs TRL's GRPOTrainer on the same workload, measured side by side in one run.

    python bench/vs_trl.py                                  # what a user gets: both sides' defaults, 3 runs each
    python bench/vs_trl.py --model smollm2 --prompts 4 --lr 1e-5   # SmolLM2-135M-Instruct, P = 4
    python bench/vs_trl.py --curve --steps 20 --seeds 0 1 2 # training curves (reward per step)

Each run is a fresh subprocess (clean peak RSS, same start-up) of `--steps` steps (30: 60 optimizer
steps with μ = 2); the runs alternate grpolab, TRL, grpolab, TRL, ... (`--runs` of each). The
headline is the whole run: model loading and trainer setup, then training, compilation included
(framework imports left out on both sides). One "step" = one generation round (P × G completions) +
μ optimizer steps over it; TRL's max_steps counts optimizer steps, so it is given μ × steps. Both
sides: same model folder, same prompts, same reward (bench/common.py), P, G, max completion length,
μ, β (k3 KL, not ratio-weighted), clip ε = 0.2, token-mean loss over the optimizer step ("dapo"),
constant learning rate, AdamW, grad-norm clip 1.0, sample std of the group rewards, same seed.
Every speed setting is each side's default unless a flag sets it (grpolab's `auto` switches as
decided at setup; TRL's gradient checkpointing on, torch_compile off); the precision is float32 on
both sides, or bf16 on both where the CPU computes it natively (each side's default there).

Printed per side (median over runs): the whole run's seconds and optimizer steps/s, setup, the first
step, then per-step medians (s/step, generated tokens/s, generation, scoring, old+ref log-probs,
learning) and peak RSS; the settings each side ran with; then grpolab/TRL ratios.
TRL is a bench-only dependency (`pip install trl==1.16.0`); it runs on CPU without vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    GRPOLAB_OPTIONS,
    Workload,
    add_grpolab_flags,
    cpu_description,
    digit_rewards,
    grpolab_options,
    import_model_code,
    load_tokenizer,
    model_dir,
    peak_rss_mb,
    prompt_set,
    set_threads,
)

PHASES = ("generate", "score", "logprob", "learn")


# --------------------------------------------------------------------------- grpolab side


def run_grpolab(w: Workload, steps: int, warmup: int, between_steps: Callable[[], None] | None = None) -> dict:
    """Runs the workload through grpolab's loop; per-step phase times, the setup and training seconds
    (`clock`) and peak RSS. between_steps: called once before the first step and after each step,
    outside every phase timer."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpolab import config as C
    from grpolab.config.validation import get_field
    from grpolab.data.arith import PromptItem
    from grpolab.data.stream import ListStream
    from grpolab.grpo import loop as grpo
    from grpolab.grpo.setup import build_setup

    import_model_code(model_dir(w.model))
    t0 = time.perf_counter()  # the run: model load and setup, then training (compilation included)
    _register_reward()
    path = model_dir(w.model)
    tok = load_tokenizer(path)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    items = [PromptItem(p["prompt"], {"answer": p["answer"], "answerable": True}) for p in prompt_set(model=w.model)]
    cfg = C.from_preset("grpo", [
        f"model.dtype={w.dtype}", f"rollout.prompts_per_step={w.prompts_per_step}",
        f"rollout.group_size={w.group_size}", f"rollout.max_new_tokens={w.max_new_tokens}",
        f"rollout.temperature={w.temperature}", f"loss.kl_coef={w.beta}", "loss.kl_ratio_weighted=false",
        "loss.loss_agg=token-mean", "loss.clip_eps_low=0.2", "loss.clip_eps_high=0.2", "loss.std=sample",
        "loss.std_eps=0.0001", f"train.epochs={w.epochs}", f"train.minibatch_size={w.sequences_per_step}",
        f"train.microbatch_size={w.microbatch_size}", f"train.lr={w.lr}", f"train.seed={w.seed}",
        f"train.steps={warmup + steps}", "train.max_grad_norm=1.0", "run.progress=false",
        "run.tensorboard=false", "run.peak_tflops=1", "data.max_prompt_tokens=64", *grpolab_overrides(w),
    ])
    cfg = cfg.replace(rewards=[{"name": "bench_digits", "weight": 1.0}])
    torch.manual_seed(w.seed)
    s = build_setup(cfg, policy=policy, tokenizer=tok, prompts=ListStream(items, seed=w.seed))
    if between_steps is not None:
        between_steps()
        s.services.hooks.append(lambda *_: between_steps())  # the loop's own per-step hooks, after the step's timers
    t1 = time.perf_counter()
    rows = grpo.train(s)
    clock = {"setup_s": t1 - t0, "train_s": time.perf_counter() - t1}
    out = []
    for r in rows:
        tokens = r["len/mean"] * w.sequences_per_step
        out.append({"step_s": r["time/step_s"], "generate": r["time/rollout_s"], "score": r["time/score_s"],
                    "logprob": r["time/logprob_s"], "learn": r["time/learn_s"], "gen_tokens": tokens,
                    "reward": r["reward/mean"], "kl": r["kl"]})
    speed = {k: get_field(s.cfg, k) for k in SPEED_FIELDS}  # s.cfg holds the auto switches as decided
    return {"steps": out, "warmup": warmup, "peak_rss_mb": peak_rss_mb(), **clock, "speed": speed}


SPEED_FIELDS = ("model.dtype", *(field_name for field_name, _ in GRPOLAB_OPTIONS.values()))
"""The grpolab settings a run reports (as it ran them: `auto` ones as decided at setup)."""

ONE_DTYPE_ONLY = {"bf16_weights": "bfloat16", "packed_weights": "float32"}
"""grpolab switches that apply to one compute dtype only: set off in runs of the other."""


def grpolab_overrides(w: Workload) -> list[str]:
    """The config overrides of the workload's grpolab_* switches that are set (None: grpolab's default)."""
    out = []
    for name, (field_name, _) in GRPOLAB_OPTIONS.items():
        value = getattr(w, "grpolab_" + name)
        if value is None:
            continue
        if name == "cpp_wrapper":
            value = value and bool(w.grpolab_compile)
        if name in ONE_DTYPE_ONLY:
            value = value and w.dtype == ONE_DTYPE_ONLY[name]
        out.append(f"{field_name}={str(value).lower() if isinstance(value, bool) else value}")
    return out


def _register_reward() -> None:
    from grpolab.rewards.base import register_reward, reward_names

    if "bench_digits" in reward_names():
        return

    @register_reward("bench_digits")
    def factory():
        def digits(prompts, completions, metadata):
            return digit_rewards(completions, [m["answer"] for m in metadata])
        return digits


# --------------------------------------------------------------------------- TRL side


def run_trl(w: Workload, steps: int, warmup: int) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import_model_code(model_dir(w.model))
    t0 = time.perf_counter()  # the run: model loads and trainer setup, then training (compilation included)
    path = model_dir(w.model)
    tok = load_tokenizer(path)
    ds = Dataset.from_list(prompt_set(model=w.model))
    optional = {k: v for k, v in (("torch_compile", w.trl_compile),
                                  ("gradient_checkpointing", w.trl_gradient_checkpointing)) if v is not None}

    def reward(prompts, completions, answer, **kw):
        return digit_rewards(completions, answer)

    with tempfile.TemporaryDirectory() as out_dir:
        args = GRPOConfig(
            output_dir=out_dir, per_device_train_batch_size=w.microbatch_size,
            gradient_accumulation_steps=w.accumulation, num_generations=w.group_size,
            max_completion_length=w.max_new_tokens, num_iterations=w.epochs, beta=w.beta, loss_type="dapo",
            epsilon=0.2, scale_rewards="group", learning_rate=w.lr, lr_scheduler_type="constant",
            warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, temperature=w.temperature, top_k=0, top_p=1.0,
            seed=w.seed, bf16=w.dtype == "bfloat16", fp16=False, use_cpu=True,
            max_steps=w.epochs * (warmup + steps), logging_steps=10**6, report_to="none", save_strategy="no",
            disable_tqdm=True, dataloader_num_workers=0, log_completions=False, **optional,
        )
        trainer = GRPOTrainer(model=str(path), reward_funcs=reward, args=args, train_dataset=ds,
                              processing_class=tok)
        clock = _TrlClock(trainer, w.epochs)
        trainer.add_callback(clock.callback(TrainerCallback))
        t1 = time.perf_counter()
        trainer.train()
        times = {"setup_s": t1 - t0, "train_s": time.perf_counter() - t1}
        speed = {"bf16": args.bf16, "torch_compile": args.torch_compile,
                 "gradient_checkpointing": args.gradient_checkpointing}
    return {"steps": clock.rows(), "warmup": warmup, "peak_rss_mb": peak_rss_mb(), **times, "speed": speed}


class _TrlClock:
    """Wraps TRL's phase methods with timers; one row per generation round."""

    def __init__(self, trainer, epochs: int):
        import torch

        self.epochs, self.t_opt, self.cur, self.done = epochs, [], None, []
        self.t0 = time.perf_counter()
        gen_score = trainer._generate_and_score_completions
        gen, logps, rewards = trainer._generate, trainer._get_per_token_logps_and_entropies, trainer._calculate_rewards

        def timed(fn, key, only_no_grad=False):
            def wrapper(*a, **k):
                if only_no_grad and torch.is_grad_enabled():
                    return fn(*a, **k)
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    if self.cur is not None:
                        self.cur[key] += time.perf_counter() - t
            return wrapper

        def phase_a(*a, **k):
            self.cur = {p: 0.0 for p in PHASES} | {"phase_a": 0.0}
            t = time.perf_counter()
            out = gen_score(*a, **k)
            self.cur["phase_a"] = time.perf_counter() - t
            mask = out["completion_mask"]
            self.cur["gen_tokens"] = float(mask.sum())
            self.done.append(self.cur)
            return out

        trainer._generate_and_score_completions = phase_a
        trainer._generate = timed(gen, "generate")
        trainer._get_per_token_logps_and_entropies = timed(logps, "logprob", only_no_grad=True)
        trainer._calculate_rewards = timed(rewards, "score")
        self.trainer = trainer

    def callback(self, base):
        clock = self

        class Clock(base):
            def on_step_end(self, args, state, control, **kw):
                clock.t_opt.append(time.perf_counter())
                if state.global_step % clock.epochs == 0 and clock.done:
                    clock.done[-1]["reward"] = float(clock.trainer._metrics["train"]["reward"][-1])
        return Clock()

    def rows(self) -> list[dict]:
        out, prev = [], self.t0
        for i, row in enumerate(self.done):
            end = self.t_opt[(i + 1) * self.epochs - 1]
            step_s = end - prev
            prev = end
            gen_tok = row.pop("gen_tokens")
            phase_a = row.pop("phase_a")
            out.append({"step_s": step_s, "generate": row["generate"], "score": row["score"],
                        "logprob": row["logprob"], "learn": step_s - phase_a, "gen_tokens": gen_tok,
                        "reward": row.get("reward", float("nan"))})
        return out


# --------------------------------------------------------------------------- driver


def child(args) -> None:
    set_threads(args.threads)
    w = Workload.from_json(args.workload)
    fn = run_grpolab if args.side == "grpolab" else run_trl
    res = fn(w, args.steps, args.warmup)
    print("@@RESULT " + json.dumps(res), flush=True)


def spawn(side: str, w: Workload, steps: int, warmup: int, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--child", "--side", side, "--workload", w.to_json(),
           "--steps", str(steps), "--warmup", str(warmup), "--threads", str(threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads > 0 else dict(os.environ)
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("@@RESULT "):
            return json.loads(line[len("@@RESULT "):])
    raise RuntimeError(f"{side} run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


def summarize(res: dict, epochs: int) -> dict:
    """One run: the whole run (setup + training, compilation included; `run_s`, optimizer steps per
    second over it) and the medians over the timed steps."""
    timed = res["steps"][res["warmup"]:]
    med = {k: statistics.median(r[k] for r in timed) for k in ("step_s", *PHASES, "gen_tokens")}
    med["tokens_per_s"] = statistics.median(r["gen_tokens"] / r["generate"] for r in timed)
    med["peak_rss_mb"] = res["peak_rss_mb"]
    med["setup_s"], med["train_s"] = res["setup_s"], res["train_s"]
    med["run_s"] = res["setup_s"] + res["train_s"]
    med["first_step_s"] = res["steps"][0]["step_s"]
    med["opt_steps_per_s"] = epochs * len(res["steps"]) / med["run_s"]
    return med


def report(name: str, runs: dict[str, list[dict]]) -> dict:
    meds = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "speed"} for side, rs in runs.items()}
    print(f"\n== {name} (median of {len(next(iter(runs.values())))} runs each; {cpu_description()})")
    print(f"{'side':8} {'run s':>7} {'opt st/s':>8} {'setup':>6} {'1st st':>6} {'s/step':>7} {'gen tok/s':>9} "
          + " ".join(f"{p:>8}" for p in PHASES) + f" {'RSS MB':>7}")
    for side, m in meds.items():
        print(f"{side:8} {m['run_s']:7.1f} {m['opt_steps_per_s']:8.3f} {m['setup_s']:6.1f} {m['first_step_s']:6.2f} "
              f"{m['step_s']:7.3f} {m['tokens_per_s']:9.0f} " + " ".join(f"{m[p]:8.3f}" for p in PHASES)
              + f" {m['peak_rss_mb']:7.0f}")
    for side, rs in runs.items():
        print(f"{side} settings: " + ", ".join(f"{k}={v}" for k, v in rs[0].get("speed", {}).items()))
    if len(meds) == 2:
        g, t = meds["grpolab"], meds["trl"]
        print(f"grpolab/TRL, whole run: steps/s x{t['run_s'] / g['run_s']:.2f}, peak RSS "
              f"{g['peak_rss_mb'] / t['peak_rss_mb']:.2f}; per timed step: x{t['step_s'] / g['step_s']:.2f} "
              f"(generation x{t['generate'] / g['generate']:.2f}, learn x{t['learn'] / g['learn']:.2f})")
        pairs = [b["run_s"] / a["run_s"] for a, b in zip(runs["grpolab"], runs["trl"])]
        rss = [max(r["peak_rss_mb"] for r in runs[side]) for side in ("grpolab", "trl")]
        print("per pair (run i of each side), whole run: steps/s x" + ", x".join(f"{p:.2f}" for p in pairs)
              + f"; largest peak RSS {rss[0]:.0f} / {rss[1]:.0f} MB")
    return meds


def workload(args, dtype: str, seed: int) -> Workload:
    """The command line's workload (the speed runs and the training curves use the same settings)."""
    return Workload(model=args.model, prompts_per_step=args.prompts, group_size=args.group_size,
                    max_new_tokens=args.max_new_tokens, epochs=args.epochs, beta=args.beta, lr=args.lr,
                    microbatch_size=args.microbatch, seed=seed, dtype=dtype, trl_compile=args.trl_compile,
                    trl_gradient_checkpointing=args.trl_gradient_checkpointing, **grpolab_options(args))


def speed(args) -> None:
    out = {}
    for dtype in args.dtype:
        w = workload(args, dtype, args.seed)
        runs: dict[str, list[dict]] = {s: [] for s in args.sides}
        for i in range(args.runs):
            for side in args.sides:  # A B A B: both sides see the same machine conditions
                load = os.getloadavg()[0]
                res = spawn(side, w, args.steps, args.warmup, args.threads)
                med = summarize(res, w.epochs) | {"load": load, "speed": res.get("speed", {})}
                runs[side].append(med)
                print(f"run {i + 1} {side:8} {dtype}: run {med['run_s']:.1f} s (setup {med['setup_s']:.1f}, first step "
                      f"{med['first_step_s']:.2f}), {med['step_s']:.3f} s/step, peak RSS {med['peak_rss_mb']:.0f} MB "
                      f"(load {load:.1f})", flush=True)
        out[dtype] = {"runs": runs, "median": None}
        out[dtype]["median"] = report(f"{args.model} {dtype}, P={w.prompts_per_step} G={w.group_size} "
                            f"L={w.max_new_tokens} mu={w.epochs} beta={w.beta}, {args.threads or 'default'} threads",
                            runs)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


def curve(args) -> None:
    """Reward per step, per side and seed, then the mean over seeds side by side."""
    curves: dict[str, list[list[float]]] = {s: [] for s in args.sides}
    for seed in args.seeds:
        w = workload(args, args.dtype[0], seed)
        for side in args.sides:
            res = spawn(side, w, args.steps, 0, args.threads)
            curves[side].append([r["reward"] for r in res["steps"]])
            print(f"seed {seed} {side:8}: " + " ".join(f"{x:.3f}" for x in curves[side][-1]), flush=True)
    print("\nmean reward per step over seeds")
    for side, cs in curves.items():
        print(f"{side:8}: " + " ".join(f"{statistics.mean(c[i] for c in cs):.3f}" for i in range(len(cs[0]))))
    if args.json:
        Path(args.json).write_text(json.dumps(curves, indent=1))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    p.add_argument("--dtype", nargs="+", choices=("float32", "bfloat16"), default=None,
                   help="default: each side's default precision where this CPU computes bf16 natively (AVX512-BF16, "
                   "AMX): bfloat16; else float32 on both sides")
    p.add_argument("--runs", type=int, default=3, help="runs per side (alternating)")
    p.add_argument("--steps", type=int, default=30,
                   help="timed steps (generation rounds) per run; each is --epochs optimizer steps")
    p.add_argument("--warmup", type=int, default=0, help="steps per run left out of the per-step medians "
                   "(never out of the whole-run time)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (P)")
    p.add_argument("--group-size", type=int, default=8, help="G")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--epochs", type=int, default=2, help="mu (TRL num_iterations)")
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--microbatch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    add_grpolab_flags(p, "grpolab-", "grpolab side: ")
    p.add_argument("--trl-compile", action=argparse.BooleanOptionalAction, default=None,
                   help="TRL side: torch_compile (absent: TRL's default, off)")
    p.add_argument("--trl-gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="TRL side: gradient_checkpointing (absent: TRL's default, on)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per run (0 = torch's default)")
    p.add_argument("--sides", nargs="+", choices=("grpolab", "trl"), default=["grpolab", "trl"])
    p.add_argument("--curve", action="store_true", help="training curves over --seeds instead of timing")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--json", default="", help="write the results here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--side", default="grpolab", help=argparse.SUPPRESS)
    p.add_argument("--workload", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dtype is None:
        args.dtype = default_dtypes()
    return args


def default_dtypes() -> list[str]:
    """Each side's default precision where the CPU computes bf16 natively (grpolab's model.dtype=auto and
    TRL's bf16=True are both bf16 there); float32 elsewhere (an AVX2-only CPU), where torch emulates bf16,
    far slower than float32, and a bf16 run would time the emulation."""
    from grpolab.hardware import cpu_supports_bf16

    return ["bfloat16"] if cpu_supports_bf16() else ["float32"]


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args)
    elif args.curve:
        curve(args)
    else:
        speed(args)


if __name__ == "__main__":
    main()
