"""`grpolab rm`: train a reward model on preference pairs and save it as an HF folder.

    grpolab rm --data builtin:accuracy --out runs/rm_acc              # built-in arithmetic pairs
    grpolab rm --data prefs.jsonl --base path/to/hf_model --out rm/ --steps 500 --lr 1e-5

Batch sizes count pairs; the defaults follow the recipe of the accuracy and refusal reward models
(batch 8 = microbatch 1 x 8 accumulation).
Held-out pairs: for builtin data, fresh pairs from the task's held-out (eval) side; for a file,
--eval-data, or else the last --eval-fraction of a seeded shuffle of the file's pairs.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

BUILTIN_DATA = ("builtin:accuracy", "builtin:refusal")


def add_arguments(r: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`grpolab rm`'s options, on parser r: the command line's and the pipeline's reward_models entries'."""
    r.add_argument("--data", required=True, help="a .jsonl / .parquet / .arrow file or dataset folder of "
                   "{prompt, chosen, rejected} rows, or builtin:accuracy | builtin:refusal")
    r.add_argument("--out", required=True, help="output folder (an HF folder plus grpolab_rm.json)")
    r.add_argument("--overwrite", action="store_true",
                   help="when --out holds a reward model or a run, move it aside (OUT.old-<time>; nothing is deleted)")
    r.add_argument("--base", default="builtin:tiny",
                   help="backbone: builtin:tiny, an HF folder (causal LM or encoder), a .gguf, or a shortcut")
    r.add_argument("--eval-data", default=None, help="held-out pairs file (default: see --eval-fraction)")
    r.add_argument("--eval-fraction", type=float, default=0.1,
                   help="share of a data file's pairs held out when --eval-data is not given")
    r.add_argument("--steps", type=int, default=None, help="optimizer steps (default: 1 epoch of a file; 300 builtin)")
    r.add_argument("--epochs", type=float, default=None, help="passes over the training pairs (instead of --steps)")
    r.add_argument("--batch-size", type=int, default=8, help="pairs per optimizer step")
    r.add_argument("--microbatch-size", type=int, default=1, help="pairs per forward/backward (accumulated)")
    r.add_argument("--lr", type=float, default=None,
                   help="AdamW learning rate (default 1e-3 for builtin:tiny, else 1e-5)")
    r.add_argument("--lm-coef", type=float, default=0.0,
                   help="weight of an auxiliary LM loss on the chosen completion (decoder RMs; "
                   "helps an RM that must check the answer itself, e.g. builtin:accuracy)")
    r.add_argument("--divergence-coef", type=float, default=0.0,
                   help="weight of the pairwise loss at the first token where chosen and rejected part "
                   "(decoder RMs)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--device", default="cpu")
    r.add_argument("--system-prompt", default=None, help="system prompt for chat-template rendering")
    r.add_argument("--pairs", type=int, default=None, help="builtin: training pairs (default steps x batch size)")
    r.add_argument("--heldout-pairs", type=int, default=1000, help="builtin: held-out pairs to evaluate on")
    r.add_argument("--arith-ops", default="+-*/", help="builtin: operations of the arithmetic task")
    r.add_argument("--split-seed", type=int, default=0, help="builtin: seed of the task's train/held-out split "
                   "(use the GRPO run's data.seed)")
    r.add_argument("--policy", default=None, help="also report the RM's pair accuracy on this policy's own samples "
                   "(an HF causal LM folder sharing the RM's tokenizer), e.g. the π0 GRPO will start from")
    r.add_argument("--policy-prompts", type=int, default=256, help="--policy: held-out prompts to sample")
    r.add_argument("--policy-samples", type=int, default=8, help="--policy: completions per prompt")
    r.add_argument("--max-new-tokens", type=int, default=8, help="--policy: token limit of a sample")
    r.add_argument("--labeler", default=None, help="--policy: the reward that judges the samples (a reward name "
                   "or module:attr; builtin data: exact_match for accuracy, refusal for refusal)")
    r.add_argument("--hidden-size", type=int, default=64, help="builtin:tiny: hidden width")
    r.add_argument("--num-layers", type=int, default=2, help="builtin:tiny: layers")
    return r


def _builtin_pairs(args):
    from grpolab.data.arith import ArithTask
    from grpolab.data.preferences import accuracy_pairs, refusal_pairs

    task = ArithTask(seed=args.split_seed, ops=args.arith_ops)
    make = accuracy_pairs if args.data == "builtin:accuracy" else refusal_pairs
    steps = args.steps if args.steps is not None else (None if args.epochs else 300)
    n = args.pairs or (steps * args.batch_size if steps else 2400)
    train = make(task, random.Random(args.seed), n, split="train")
    heldout = make(task, random.Random(args.seed + 1), args.heldout_pairs, split="eval")
    return train, heldout, steps


def _file_pairs(args, tokenizer):
    from grpolab.data.preferences import load_pairs

    pairs = load_pairs(args.data, tokenizer=tokenizer, system_prompt=args.system_prompt)
    if args.eval_data:
        return pairs, load_pairs(args.eval_data, tokenizer=tokenizer, system_prompt=args.system_prompt)
    if not 0.0 <= args.eval_fraction < 1.0:
        raise ValueError(f"--eval-fraction must be in [0, 1), got {args.eval_fraction}")
    order = list(range(len(pairs)))
    random.Random(args.seed).shuffle(order)
    k = round(len(pairs) * args.eval_fraction)
    if k == 0:
        return pairs, []
    return [pairs[i] for i in order[:-k]], [pairs[i] for i in order[-k:]]


def _policy_items(args, heldout):
    """The prompts the policy samples: the task's held-out side (builtin data) or the held-out pairs'."""
    from grpolab.data.arith import ArithTask, PromptItem

    if args.data in BUILTIN_DATA:
        task = ArithTask(seed=args.split_seed, ops=args.arith_ops)
        return task.eval_items(args.policy_prompts)
    prompts = list(dict.fromkeys(p.prompt for p in heldout))[: args.policy_prompts]
    return [PromptItem(p, {}) for p in prompts]


def _policy_accuracy(args, model, tokenizer, heldout) -> dict:
    """The RM's pair accuracy on --policy's samples (evaluation.reward_models.policy_pair_accuracy)."""
    from grpolab.models.loading import load_model
    from grpolab.rewards.registry import build_reward
    from grpolab.rewards.reward_model import RewardModelReward
    from grpolab.evaluation.reward_models import policy_pair_accuracy

    labeler = args.labeler or {"builtin:accuracy": "exact_match", "builtin:refusal": "refusal"}.get(args.data)
    if not labeler:
        raise ValueError("--policy: name the reward that judges the policy's samples with --labeler "
                         "(e.g. exact_match, or module:attr)")
    policy, _ = load_model(args.policy)
    rm = RewardModelReward.from_model(model, tokenizer)
    items = _policy_items(args, heldout)
    acc = policy_pair_accuracy({"rm": rm}, {"rm": build_reward(labeler)}, policy, tokenizer, items,
                               group_size=args.policy_samples, max_new_tokens=args.max_new_tokens, seed=args.seed)
    return {"accuracy": acc["rm"], "prompts": len(items), "samples": args.policy_samples, "labeler": labeler,
            "policy": args.policy}


def train(args) -> int:
    """`grpolab rm` with parsed args; bad input raises (ValueError, FileNotFoundError, FileExistsError)."""
    from grpolab.rundir.rundir import claim, recording_failure

    claim(Path(args.out), "rm", overwrite=args.overwrite, field="--out", say=lambda m: print(m, file=sys.stderr))
    with recording_failure(Path(args.out)):  # run.json: failed, with the error
        return _fit(args)


def _fit(args) -> int:
    """`grpolab rm` in its claimed --out folder."""
    from grpolab.reward_models.model import TINY_BASE, base_tokenizer, build_reward_model, save_reward_model
    from grpolab.reward_models.training import fit_calibration, score_stats, train_reward_model
    from grpolab.rundir.rundir import mark_finished

    tiny = dict(hidden_size=args.hidden_size, num_layers=args.num_layers) if args.base == TINY_BASE else {}
    tokenizer = base_tokenizer(args.base)
    if args.data in BUILTIN_DATA:
        train, heldout, steps = _builtin_pairs(args)
    elif args.data.startswith("builtin:"):
        raise ValueError(f"--data {args.data!r}: unknown built-in data; known: {', '.join(BUILTIN_DATA)}")
    else:
        train, heldout = _file_pairs(args, tokenizer)
        steps = args.steps
    epochs = args.epochs if steps is None else None
    if steps is None and epochs is None:
        epochs = 1.0
    lr = args.lr if args.lr is not None else (1e-3 if args.base == TINY_BASE else 1e-5)
    model = build_reward_model(args.base, tokenizer, seed=args.seed, **tiny).to(args.device)
    print(f"[rm] {len(train)} training pairs, {len(heldout)} held-out; base {args.base}; "
          f"batch {args.batch_size} = microbatch {args.microbatch_size} x "
          f"{args.batch_size // max(1, args.microbatch_size)} accumulation; lr {lr}", file=sys.stderr)

    def on_step(i: int, loss: float) -> None:
        if (i + 1) % 50 == 0:
            print(f"[rm] step {i + 1} loss {loss:.4f}", file=sys.stderr, flush=True)

    result = train_reward_model(model, tokenizer, train, steps=steps, epochs=epochs, batch_size=args.batch_size,
                                microbatch_size=args.microbatch_size, lr=lr, seed=args.seed,
                                eval_pairs=heldout or None, on_step=on_step, lm_coef=args.lm_coef,
                                divergence_coef=args.divergence_coef)
    mean, std = score_stats(model, tokenizer, train)
    calib = fit_calibration(model, tokenizer, train)
    on_policy = _policy_accuracy(args, model, tokenizer, heldout) if args.policy else None
    info = {"score_mean": mean, "score_std": std, "calibration": calib, "data": args.data, "base": args.base,
            "heldout_accuracy": result.heldout_accuracy, "heldout_margin": result.heldout_margin,
            "train_pairs": len(train), "heldout_pairs": len(heldout),
            "lm_coef": args.lm_coef, "divergence_coef": args.divergence_coef, "lr": lr,
            "batch_size": args.batch_size, **({"policy_pair_accuracy": on_policy} if on_policy else {})}
    out = save_reward_model(model, tokenizer, args.out, info=info, pairs=train)
    mark_finished(Path(args.out))
    if result.heldout_accuracy is None:
        print("held-out pairwise accuracy: n/a (no held-out pairs)")
    else:
        print(f"held-out pairwise accuracy: {result.heldout_accuracy:.4f}  mean margin: "
              f"{result.heldout_margin:.4f}  ({len(heldout)} pairs)")
    if on_policy:
        print(f"pair accuracy on the policy's samples: {on_policy['accuracy']:.4f}  ({on_policy['prompts']} "
              f"prompts x {args.policy_samples}, judged by {on_policy['labeler']})")
    print(f"training: {len(result.train_losses)} steps in {result.seconds:.1f} s, final loss "
          f"{result.train_losses[-1]:.4f}")
    print(f"saved: {out}")
    return 0
