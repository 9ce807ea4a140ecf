"""GRPO on a real model, offline: SmolLM2-135M-Instruct learns reasoning-gym `chain_sum`.

    python bench/real_model.py                         # the acceptance run (see bench/README.md)
    python bench/real_model.py --steps 2 --prompts 4 --group-size 4 --max-new-tokens 32 --eval-size 16
    python bench/real_model.py --write-data            # (re)writes examples/data/chain_sum/ (the split below)

The run is examples/smollm2_chain_sum.yaml (`grpolab train` runs the same config); the flags
override its fields. Task: `chain_sum` with min_terms = max_terms = 2 and min_digits = max_digits =
1 ("State the final answer to the following arithmetic problem: 4 - 1 ="), through SmolLM2's chat
template with an explicit system prompt (the text the template would insert anyway). Reward: the
last integer of the completion, checked by the task's own `score_answer`; only 1.0 counts (1/0).

Held-out split (examples/data/chain_sum/, written by --write-data): the task has only 200 distinct
questions (10 × 10 digit pairs × {+, -}). heldout.jsonl is the first 128 distinct questions drawn
with --eval-seed; train.jsonl every distinct question drawn with --seed that is not held out. No
held-out question string is in the training set (checked when the files are read; the run stops
otherwise).

Evaluation is `grpolab eval`'s (`grpolab.evaluation.evaluate.evaluate_policy`): the held-out mean reward,
greedy and sampled at the training temperature (--eval-samples per prompt, sampling seeded by
train.seed), for π0, every --eval-every steps and at the end; `grpolab eval smollm2-135m-instruct
examples/smollm2_chain_sum.yaml --samples 2` gives the π0 row. Written to --out: config.yaml,
metrics.jsonl, samples.jsonl (grpolab's run-dir writers) and summary.json.
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
from grpolab.data.build import prompt_stream
from grpolab.data.sources import reasoning_gym_items
from grpolab.grpo import loop as grpo
from grpolab.evaluation.evaluate import eval_items, evaluate_policy
from grpolab.grpo.run import attach_outputs
from grpolab.rundir.rundir import write_config
from grpolab.grpo.setup import build_setup

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "smollm2_chain_sum.yaml"
DATA = ROOT / "examples" / "data" / "chain_sum"
TASK = "chain_sum"
TASK_PARAMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
DRAW_SIZE = 4000  # questions drawn per seed before de-duplication (the task has 200 distinct ones)
EVAL_SIZE = 128  # held-out questions written by --write-data


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Flags left at None keep the example config's value."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model shortcut, HF folder or .gguf (model.name_or_path)")
    p.add_argument("--steps", type=int, default=None, help="GRPO steps (train.steps)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step, P (rollout.prompts_per_step)")
    p.add_argument("--group-size", type=int, default=None, help="completions per prompt, G (rollout.group_size)")
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate (train.lr)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="longest completion; longer scores 0")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (train and sampled eval)")
    p.add_argument("--microbatch", type=int, default=None, help="sequences per forward/backward")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="compute dtype; bfloat16 = autocast, master weights stay float32")
    p.add_argument("--lora-rank", type=int, default=None, help="LoRA rank; 0 = full fine-tune")
    p.add_argument("--eval-size", type=int, default=None, help="held-out prompts (data.eval_prompts)")
    p.add_argument("--eval-samples", type=int, default=2, help="sampled completions per held-out prompt")
    p.add_argument("--eval-every", type=int, default=15, help="held-out evaluation every N steps (0 = only at the end)")
    p.add_argument("--system-prompt", default=None, help="system message of the chat template (data.system_prompt)")
    p.add_argument("--seed", type=int, default=0, help="seed of training prompts, sampling and shuffling")
    p.add_argument("--eval-seed", type=int, default=12345, help="--write-data: seed of the held-out questions")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (0 = torch's default); on an oversubscribed CPU 1 can be several times faster")
    p.add_argument("--time-limit-min", type=float, default=0.0,
                   help="stop training after this many minutes (then the final evaluation runs); 0 = no limit")
    p.add_argument("--write-data", action="store_true", help="write the split to examples/data/chain_sum/ and exit")
    p.add_argument("--out", default="runs/real_model", help="output folder")
    args = p.parse_args(argv)
    if args.eval_seed == args.seed:
        p.error("--eval-seed must differ from --seed")
    return args


FLAGS = {"model": "model.name_or_path", "dtype": "model.dtype", "lora_rank": "model.lora_rank",
         "eval_size": "data.eval_prompts", "prompts": "rollout.prompts_per_step", "group_size": "rollout.group_size",
         "max_new_tokens": "rollout.max_new_tokens", "temperature": "rollout.temperature", "steps": "train.steps",
         "lr": "train.lr", "seed": "train.seed"}


def bench_config(args: argparse.Namespace) -> C.Config:
    """examples/smollm2_chain_sum.yaml with the given flags: grpo_no_kl (no reference model), zero-variance
    groups dropped from the loss, one epoch and one minibatch per step (ratio exactly 1, no π_old pass)."""
    base = C.load(str(EXAMPLE))
    n = (args.prompts or base.rollout.prompts_per_step) * (args.group_size or base.rollout.group_size)
    overrides = [f"{key}={getattr(args, flag)}" for flag, key in FLAGS.items() if getattr(args, flag) is not None]
    overrides += [f"train.microbatch_size={min(args.microbatch or base.train.microbatch_size, n)}",
                  f"data.source=jsonl:{DATA / 'train.jsonl'}", f"data.eval_source=jsonl:{DATA / 'heldout.jsonl'}",
                  f"run.out_dir={args.out}", "run.tensorboard=false", "run.progress=false"]
    cfg = C.load(str(EXAMPLE), overrides)
    if args.system_prompt is not None:  # free text (commas, quotes): set directly, not through the override parser
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, system_prompt=args.system_prompt))
    return cfg.validate()


# --------------------------------------------------------------------------- data


def _question(it: PromptItem) -> str:
    return it.meta["rg_entry"]["question"]


def _distinct(items: list[PromptItem]) -> list[PromptItem]:
    seen, out = set(), []
    for it in items:
        if _question(it) not in seen:
            seen.add(_question(it))
            out.append(it)
    return out


def build_splits(args: argparse.Namespace, eval_size: int = EVAL_SIZE) -> tuple[list[PromptItem], list[PromptItem]]:
    """(train items, held-out items) of raw questions: distinct, disjoint by question string."""
    held = _distinct(reasoning_gym_items(TASK, size=DRAW_SIZE, seed=args.eval_seed, **TASK_PARAMS))
    if len(held) < eval_size:
        raise ValueError(f"{eval_size} held-out questions: {TASK} with {TASK_PARAMS} has only {len(held)} distinct")
    held = held[:eval_size]
    held_q = {_question(it) for it in held}
    train = [it for it in _distinct(reasoning_gym_items(TASK, size=DRAW_SIZE, seed=args.seed, **TASK_PARAMS))
             if _question(it) not in held_q]
    if not train:
        raise ValueError(f"{eval_size} held-out questions leave none to train on")
    return train, held


def write_data(args: argparse.Namespace, out: Path = DATA) -> None:
    """train.jsonl / heldout.jsonl: {"prompt": question, answer, rg_task, rg_params, rg_entry} per line."""
    out.mkdir(parents=True, exist_ok=True)
    for name, items in zip(("train", "heldout"), build_splits(args)):
        with (out / f"{name}.jsonl").open("w") as f:
            for it in items:
                f.write(json.dumps({"prompt": it.prompt, **it.meta}) + "\n")
        _say(f"{out / name}.jsonl: {len(items)} questions")


def load_splits(cfg: C.Config, tokenizer: Any) -> tuple[list[PromptItem], list[PromptItem]]:
    """The config's training and held-out prompts, rendered for the model; stops if they share a question."""
    train, held = list(prompt_stream(cfg, tokenizer).items), eval_items(cfg, tokenizer)
    overlap = {_question(it) for it in held} & {_question(it) for it in train}
    if overlap:
        raise ValueError(f"held-out questions in the training set: {sorted(overlap)[:5]}")
    return train, held


# --------------------------------------------------------------------------- evaluation


def evaluate(policy, tokenizer, cfg: C.Config, held: list[PromptItem], samples: int, tag: str) -> dict:
    """`grpolab eval`'s evaluation of the policy on the held-out prompts; prints one line."""
    t = time.perf_counter()
    res = evaluate_policy(policy, tokenizer, cfg, samples=samples, items=held)
    res.pop("completions", None)  # one record per prompt: not part of summary.json
    res["seconds"] = time.perf_counter() - t
    sampled = res.get("sampled", {})
    _say(f"[eval {tag}] held-out reward sampled(T={cfg.rollout.temperature}, ×{samples}) "
         f"{sampled.get('reward', float('nan')):.3f}  greedy {res['greedy']['reward']:.3f}  ({res['seconds']:.0f} s)")
    return res


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
    return {k: v for k, v in ev.items() if k != "examples"}


def run(args: argparse.Namespace, policy=None, tokenizer=None) -> dict:
    """The whole bench; pass (policy, tokenizer) to use a model other than the config's (tests)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    times: dict[str, float] = {}
    t_all = t = time.perf_counter()
    cfg = bench_config(args)
    if policy is None:
        from grpolab.models.policy import load_policy

        policy, tokenizer = load_policy(cfg)
    times["load_s"] = time.perf_counter() - t
    t = time.perf_counter()
    train_items, held = load_splits(cfg, tokenizer)
    times["data_s"] = time.perf_counter() - t
    n_params = sum(p.numel() for p in policy.parameters())
    n_train = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    lora = cfg.model.lora_rank
    _say(f"[bench] {cfg.model.name_or_path}: {n_params / 1e6:.1f}M params, {n_train / 1e6:.2f}M trained "
         f"({'LoRA r=' + str(lora) if lora else 'full fine-tune'}), compute {cfg.model.dtype}, "
         f"{torch.get_num_threads()} threads; {len(train_items)} train / {len(held)} held-out distinct questions")
    before = evaluate(policy, tokenizer, cfg, held, args.eval_samples, "π0")
    times["eval_before_s"] = before["seconds"]

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_config(cfg, out)
    setup = build_setup(cfg, policy=policy, tokenizer=tokenizer)
    setup.should_stop = deadline(args.time_limit_min)
    logger = attach_outputs(setup, out)
    printer = StepPrinter(lambda tag: evaluate(policy, tokenizer, cfg, held, args.eval_samples, tag),
                          args.eval_every, cfg.train.steps)
    setup.services.hooks.append(printer)
    t = time.perf_counter()
    try:
        rows = grpo.train(setup)
    finally:
        logger.close()
    times["train_s"] = time.perf_counter() - t
    eval_periodic_s = sum(e["seconds"] for e in printer.evals.values())
    after = evaluate(policy, tokenizer, cfg, held, args.eval_samples, "final")
    times["eval_after_s"] = after["seconds"]
    times["total_s"] = time.perf_counter() - t_all
    summary = {
        "args": vars(args), "model": cfg.model.name_or_path, "mode": f"LoRA r={lora}" if lora else "full fine-tune",
        "temperature": cfg.rollout.temperature, "eval_samples": args.eval_samples,
        "task": {"name": TASK, **TASK_PARAMS}, "train_questions": len(train_items), "held_out_questions": len(held),
        "params": n_params, "trained_params": n_train, "threads": torch.get_num_threads(),
        "before": _slim(before), "after": _slim(after),
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
    head = (f"\n== {s['mode']}, {s['model']}, {s['task']['name']} (2 terms, 1 digit), "
            f"{s['held_out_questions']} held-out questions ==")
    lines = [head, f"{'held-out reward':<28}{'π0':>8}{'final':>8}{'change':>9}"]
    modes = [("greedy", "greedy")]
    if "sampled" in a:
        modes.insert(0, ("sampled", f"sampled T={s['temperature']} ×{s['eval_samples']}"))
    for mode, label in modes:
        x, y = b[mode]["reward"], a[mode]["reward"]
        lines.append(f"{label:<28}{x:>8.3f}{y:>8.3f}{y - x:>+9.3f}")
    for k, v in s.get("periodic_evals", {}).items():
        lines.append(f"{'  at step ' + k:<28}{'':>8}{v.get('sampled', v['greedy'])['reward']:>8.3f}  "
                     f"greedy {v['greedy']['reward']:.3f}")
    per_step = (f"per step (mean of {len(s['curve'])}): generation {pt['rollout'] / steps:.1f}s, "
                f"scoring {pt['score'] / steps:.2f}s, logprob {pt['logprob'] / steps:.1f}s, "
                f"learn {pt['learn'] / steps:.1f}s, step {pt['step'] / steps:.1f}s")
    total = (f"time: load {tm['load_s']:.0f}s, eval π0 {tm['eval_before_s']:.0f}s, train {tm['train_s']:.0f}s "
             f"(of which periodic eval {pt['periodic_eval']:.0f}s), final eval {tm['eval_after_s']:.0f}s, "
             f"total {tm['total_s']:.0f}s ({tm['total_s'] / 60:.1f} min); peak RSS {s['peak_rss_gb']:.2f} GB")
    lines += ["batch reward by step: " + " ".join(f"{c['reward']:.2f}" for c in s["curve"]), per_step, total]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.write_data:
        write_data(args)
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
