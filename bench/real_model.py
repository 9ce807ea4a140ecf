"""GRPO on a real model, offline: SmolLM2-135M-Instruct learns reasoning-gym `chain_sum`.

    python bench/real_model.py                         # the acceptance run (see bench/README.md)
    python bench/real_model.py --steps 2 --prompts 4 --group-size 4 --max-new-tokens 32 --eval-size 16

Task: `chain_sum` with min_terms = max_terms = 2 and min_digits = max_digits = 1 ("State the final
answer to the following arithmetic problem: 4 - 1 ="). The raw question goes through SmolLM2's chat
template with an explicit system prompt (by default the text the template would insert anyway, so
the prompt is the one the model was tuned with, stated rather than implied). Reward: the last
integer of the completion, checked by the task's own `score_answer`; only 1.0 counts (1/0).

Held-out split: the task has only 200 distinct questions (10 × 10 digit pairs × {+, -}). The
held-out set is the first `--eval-size` distinct questions drawn with `--eval-seed`; the training
set is every distinct question drawn with `--seed` (a different seed) that is not held out. No
held-out question string is in the training set (checked; the run stops otherwise).

Printed: π0's held-out reward (sampled at the training temperature, `--eval-samples` per prompt,
and greedy), one line per GRPO step (batch reward, groups kept, lengths, phase times), a held-out
evaluation every `--eval-every` steps, the final one, and a summary table. Written to `--out`:
config.yaml, metrics.jsonl, samples.jsonl (grpolab's run-dir writers) and summary.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from grpolab import config as C
from grpolab.data.arith import PromptItem
from grpolab.data.sources import reasoning_gym_items
from grpolab.data.stream import ListStream
from grpolab.rewards.verifiers import ReasoningGymReward
from grpolab.rollout.hf import HFEngine, decode_completions
from grpolab.train import grpo
from grpolab.train.run import attach_outputs, write_config
from grpolab.train.setup import build_setup, resolve_compute_dtype

TASK = "chain_sum"
TASK_PARAMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
DRAW_SIZE = 4000  # questions drawn per seed before de-duplication (the task has 200 distinct ones)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="model shortcut, HF folder or .gguf")
    p.add_argument("--steps", type=int, default=50, help="GRPO steps")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (P)")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate")
    p.add_argument("--max-new-tokens", type=int, default=48, help="longest completion (longer: reward 0)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (train and sampled eval)")
    p.add_argument("--microbatch", type=int, default=16, help="sequences per forward/backward")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                   help="compute dtype; bfloat16 = autocast, master weights stay float32")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA rank; 0 = full fine-tune")
    p.add_argument("--eval-size", type=int, default=128, help="held-out prompts (distinct questions)")
    p.add_argument("--eval-samples", type=int, default=2, help="sampled completions per held-out prompt")
    p.add_argument("--eval-every", type=int, default=15, help="held-out evaluation every N steps (0 = only at the end)")
    p.add_argument("--eval-batch", type=int, default=64, help="held-out prompts per generation batch")
    p.add_argument("--system-prompt", default=SMOLLM2_SYSTEM, help="system message of the chat template")
    p.add_argument("--seed", type=int, default=0, help="seed of training prompts, sampling and shuffling")
    p.add_argument("--eval-seed", type=int, default=12345, help="seed of the held-out questions (must differ)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (0 = torch's default); on an oversubscribed CPU 1 can be several times faster")
    p.add_argument("--time-limit-min", type=float, default=0.0,
                   help="stop training after this many minutes (then the final evaluation runs); 0 = no limit")
    p.add_argument("--out", default="runs/real_model", help="output folder")
    args = p.parse_args(argv)
    if args.eval_seed == args.seed:
        p.error("--eval-seed must differ from --seed")
    return args


def bench_config(args: argparse.Namespace) -> C.Config:
    """grpo_no_kl (no reference model) with zero-variance groups dropped from the loss; one epoch
    and one minibatch per step, so the importance ratio is exactly 1 (no π_old pass)."""
    n = args.prompts * args.group_size
    micro = min(args.microbatch, n)
    overrides = [
        f"model.name_or_path={args.model}", f"model.dtype={args.dtype}", f"model.lora_rank={args.lora_rank}",
        f"data.source=rg:{TASK}", f"data.eval_prompts={args.eval_size}",
        f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group_size}",
        f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.temperature={args.temperature}",
        "loss.filter_zero_std_groups=true", "loss.clip_eps_low=0.2", "loss.clip_eps_high=0.2",
        f"train.steps={args.steps}", "train.epochs=1", f"train.minibatch_size={n}",
        f"train.microbatch_size={micro}", f"train.lr={args.lr}", f"train.seed={args.seed}",
        "rewards=[reasoning_gym:1.0]", "run.tensorboard=false", "run.progress=false",
        f"run.out_dir={args.out}", "run.samples_every=5",
    ]
    cfg = C.from_preset("grpo_no_kl", overrides)
    # free text (commas, quotes): set directly rather than through the dotted-override parser
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, system_prompt=args.system_prompt)).validate()


# --------------------------------------------------------------------------- data


def _distinct(items: list[PromptItem]) -> list[PromptItem]:
    seen, out = set(), []
    for it in items:
        q = it.meta["rg_entry"]["question"]
        if q not in seen:
            seen.add(q)
            out.append(it)
    return out


def build_splits(tokenizer: Any, args: argparse.Namespace) -> tuple[list[PromptItem], list[PromptItem]]:
    """(train items, held-out items): distinct questions, disjoint by question string."""
    kw = dict(tokenizer=tokenizer, system_prompt=args.system_prompt, **TASK_PARAMS)
    held = _distinct(reasoning_gym_items(TASK, size=DRAW_SIZE, seed=args.eval_seed, **kw))
    if len(held) < args.eval_size:
        raise ValueError(f"--eval-size {args.eval_size}: {TASK} with {TASK_PARAMS} has only {len(held)} distinct questions")
    held = held[: args.eval_size]
    held_q = {it.meta["rg_entry"]["question"] for it in held}
    drawn = _distinct(reasoning_gym_items(TASK, size=DRAW_SIZE, seed=args.seed, **kw))
    train = [it for it in drawn if it.meta["rg_entry"]["question"] not in held_q]
    if not train:
        raise ValueError(f"--eval-size {args.eval_size} holds out every question; lower it")
    overlap = held_q & {it.meta["rg_entry"]["question"] for it in train}
    if overlap:  # cannot happen by construction; the acceptance asks for the check
        raise AssertionError(f"held-out questions in the training set: {sorted(overlap)[:5]}")
    return train, held


# --------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(model, engine: HFEngine, reward: ReasoningGymReward, items: list[PromptItem], *,
             greedy: bool, samples: int = 1, batch: int = 64, seed: int = 0) -> dict:
    """Held-out mean reward: greedy (one completion per prompt) or sampled (`samples` per prompt,
    prefilled once) at the engine's temperature. Returns mean, n, mean length, truncated share,
    seconds and a few examples."""
    t = time.perf_counter()
    k = 1 if greedy else samples
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    rewards, lengths, trunc, examples = [], [], [], []
    for s in range(0, len(items), batch):
        chunk = items[s : s + batch]
        ro = engine.generate_with(model, [it.prompt for it in chunk], k, generator=gen, greedy=greedy)
        texts = decode_completions(engine.tokenizer, ro)
        flags = ro.truncated.tolist()
        metas = [{**chunk[i // k].meta, "truncated": flags[i]} for i in range(len(texts))]
        rewards += reward([chunk[i // k].prompt for i in range(len(texts))], texts, metas)
        lengths += ro.completion_lengths.tolist()
        trunc += flags
        if not examples:
            examples = [{"question": chunk[i // k].meta["rg_entry"]["question"], "answer": chunk[i // k].meta["answer"],
                         "completion": texts[i], "reward": rewards[i]} for i in range(min(4, len(texts)))]
    n = len(rewards)
    return {"mean": sum(rewards) / n, "n": n, "prompts": len(items), "len_mean": sum(lengths) / n,
            "truncated_frac": sum(trunc) / n, "seconds": time.perf_counter() - t, "examples": examples}


def evaluate_both(model, engine, reward, items, args, tag: str) -> dict:
    """Sampled (training temperature) and greedy held-out reward; prints one line."""
    sampled = evaluate(model, engine, reward, items, greedy=False, samples=args.eval_samples,
                       batch=args.eval_batch, seed=args.eval_seed)
    greedy = evaluate(model, engine, reward, items, greedy=True, batch=args.eval_batch)
    _say(f"[eval {tag}] held-out reward sampled(T={args.temperature}, {sampled['n']}) {sampled['mean']:.3f}  "
         f"greedy({greedy['n']}) {greedy['mean']:.3f}  len {sampled['len_mean']:.1f}/{greedy['len_mean']:.1f}  "
         f"({sampled['seconds'] + greedy['seconds']:.0f} s)")
    return {"sampled": sampled, "greedy": greedy}


# --------------------------------------------------------------------------- the run


def _say(msg: str) -> None:
    print(msg, flush=True)


def peak_rss_gb() -> float:
    """Peak resident memory of this process (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class StepPrinter:
    """Setup hook: prints each step's metrics row and runs the periodic held-out evaluation."""

    def __init__(self, evaluate_fn, every: int, steps: int):
        self.evaluate_fn, self.every, self.steps = evaluate_fn, every, steps
        self.evals: dict[int, dict] = {}
        self.t0 = time.perf_counter()

    def __call__(self, step, row, record) -> None:
        _say(f"step {step + 1:3d}/{self.steps}  reward {row['reward/mean']:.3f}  "
             f"mixed groups {1 - row['groups/zero_std_frac']:.2f}  len {row['len/mean']:.1f} "
             f"(trunc {row['len/truncated_frac']:.2f})  entropy {row['entropy']:.3f}  "
             f"gen {row['time/rollout_s']:.1f}s  logprob {row['time/logprob_s']:.1f}s  "
             f"learn {row['time/learn_s']:.1f}s  step {row['time/step_s']:.1f}s  "
             f"total {time.perf_counter() - self.t0:.0f}s  rss {peak_rss_gb():.2f}GB")
        done = step + 1
        if self.every and done % self.every == 0 and done < self.steps:
            self.evals[done] = self.evaluate_fn(f"step {done}")


def deadline(minutes: float):
    """A Setup.should_stop replacement: True once `minutes` have passed (never with 0)."""
    end = time.perf_counter() + minutes * 60
    return (lambda: time.perf_counter() > end) if minutes > 0 else (lambda: False)


def phase_totals(rows: list[dict]) -> dict[str, float]:
    keys = {"rollout": "time/rollout_s", "score": "time/score_s", "logprob": "time/logprob_s",
            "learn": "time/learn_s", "step": "time/step_s"}
    return {k: sum(r[v] for r in rows) for k, v in keys.items()}


def _slim(ev: dict) -> dict:
    return {mode: {k: v for k, v in ev[mode].items() if k != "examples"} for mode in ev}


def run(args: argparse.Namespace, policy=None, tokenizer=None) -> dict:
    """The whole bench; pass (policy, tokenizer) to use a model other than args.model (tests)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    times: dict[str, float] = {}
    t_all = t = time.perf_counter()
    cfg = bench_config(args)
    if policy is None:
        from grpolab.train.setup import load_policy

        policy, tokenizer = load_policy(cfg)
    times["load_s"] = time.perf_counter() - t
    t = time.perf_counter()
    train_items, held = build_splits(tokenizer, args)
    times["data_s"] = time.perf_counter() - t
    n_params = sum(p.numel() for p in policy.parameters())
    n_train = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    _say(f"[bench] {args.model}: {n_params / 1e6:.1f}M params, {n_train / 1e6:.2f}M trained "
         f"({'LoRA r=' + str(args.lora_rank) if args.lora_rank else 'full fine-tune'}), compute {args.dtype}, "
         f"{torch.get_num_threads()} threads; {len(train_items)} train / {len(held)} held-out distinct questions")
    engine = HFEngine(tokenizer, args.max_new_tokens, args.temperature,
                      compute_dtype=resolve_compute_dtype(args.dtype, cfg.model.device))
    reward = ReasoningGymReward(extract="last_number")
    t = time.perf_counter()
    before = evaluate_both(policy, engine, reward, held, args, "π0")
    times["eval_before_s"] = time.perf_counter() - t

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_config(cfg, out)
    setup = build_setup(cfg, policy=policy, tokenizer=tokenizer, prompts=ListStream(train_items, seed=args.seed))
    setup.should_stop = deadline(args.time_limit_min)
    logger = attach_outputs(setup, out)
    printer = StepPrinter(lambda tag: evaluate_both(policy, engine, reward, held, args, tag), args.eval_every, args.steps)
    setup.hooks.append(printer)
    t = time.perf_counter()
    try:
        rows = grpo.train(setup)
    finally:
        logger.close()
    times["train_s"] = time.perf_counter() - t
    eval_periodic_s = sum(e["sampled"]["seconds"] + e["greedy"]["seconds"] for e in printer.evals.values())
    t = time.perf_counter()
    after = evaluate_both(policy, engine, reward, held, args, "final")
    times["eval_after_s"] = time.perf_counter() - t
    times["total_s"] = time.perf_counter() - t_all
    summary = {
        "args": vars(args), "mode": f"LoRA r={args.lora_rank}" if args.lora_rank else "full fine-tune",
        "task": {"name": TASK, **TASK_PARAMS}, "train_questions": len(train_items), "held_out_questions": len(held),
        "params": n_params, "trained_params": n_train, "threads": torch.get_num_threads(),
        "before": before, "after": after,
        "periodic_evals": {str(k): _slim(v) for k, v in printer.evals.items()},
        "curve": [{"step": r["step"] + 1, "reward": r["reward/mean"], "mixed_groups": 1 - r["groups/zero_std_frac"],
                   "len": r["len/mean"], "truncated": r["len/truncated_frac"],
                   "entropy": r["entropy"]} for r in rows],
        "phase_totals_s": {**phase_totals(rows), "periodic_eval": eval_periodic_s},
        "times_s": times, "peak_rss_gb": peak_rss_gb(),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    _say(format_summary(summary))
    return summary


def format_summary(s: dict) -> str:
    b, a = s["before"], s["after"]
    steps = max(len(s["curve"]), 1)
    pt, tm = s["phase_totals_s"], s["times_s"]
    head = (f"\n== {s['mode']}, {s['args']['model']}, {s['task']['name']} (2 terms, 1 digit), "
            f"{s['held_out_questions']} held-out questions ==")
    lines = [head, f"{'held-out reward':<28}{'π0':>8}{'final':>8}{'change':>9}"]
    for mode, label in (("sampled", f"sampled T={s['args']['temperature']} ×{s['args']['eval_samples']}"),
                        ("greedy", "greedy")):
        lines.append(f"{label:<28}{b[mode]['mean']:>8.3f}{a[mode]['mean']:>8.3f}{a[mode]['mean'] - b[mode]['mean']:>+9.3f}")
    for k, v in s.get("periodic_evals", {}).items():
        lines.append(f"{'  at step ' + k:<28}{'':>8}{v['sampled']['mean']:>8.3f}  greedy {v['greedy']['mean']:.3f}")
    per_step = (f"per step (mean of {len(s['curve'])}): generation {pt['rollout'] / steps:.1f}s, "
                f"scoring {pt['score'] / steps:.2f}s, logprob {pt['logprob'] / steps:.1f}s, "
                f"learn {pt['learn'] / steps:.1f}s, step {pt['step'] / steps:.1f}s")
    total = (f"time: load {tm['load_s']:.0f}s, eval π0 {tm['eval_before_s']:.0f}s, train {tm['train_s']:.0f}s "
             f"(of which periodic eval {pt['periodic_eval']:.0f}s), final eval {tm['eval_after_s']:.0f}s, "
             f"total {tm['total_s']:.0f}s ({tm['total_s'] / 60:.1f} min); peak RSS {s['peak_rss_gb']:.2f} GB")
    lines += ["batch reward by step: " + " ".join(f"{c['reward']:.2f}" for c in s["curve"]), per_step, total]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
