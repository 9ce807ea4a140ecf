"""The demo's two reward models (accuracy and refusal) for the built-in arithmetic task.

Two backbones (`build_demo_reward_models(backbone=...)`):
- "sft" (default): as reward models usually are, both RMs start from an SFT'd causal LM. A tiny LM
  (`DEMO_BACKBONE_SIZE`) is first SFT'd on the task's TRAINING side only (fresh examples each step,
  clean answers, plus refusals for unanswerable prompts), until it does the arithmetic; each RM is
  then that backbone with a new score head, fine-tuned on preference pairs. The accuracy RM adds two
  auxiliary terms to the pairwise loss (`lm_coef`, `divergence_coef` of train_reward_model): the
  LM loss on the chosen completion keeps the backbone computing the answer, and the pairwise loss
  at the first token where chosen and rejected part puts the signal on the digit that is wrong.
  Without them neither backbone gets past about 0.75 on "number" pairs (see below).
- "fresh": each RM is a fresh `DEMO_RM_SIZE` tiny model trained on pairs only, about 10x faster,
  good on every kind of pair but "number" pairs (the right answer vs another integer): about 0.71.

What `build_demo_reward_models` reaches, measured on the demo task (ops "+-", LSB-first answers),
1000 held-out pairs, seed 0.
"sft" (default): accuracy RM 0.953 overall, 0.90 on "number" pairs (the right answer vs another
integer on held-out facts), 1.00 on the other kinds; refusal RM 0.998; 8 min on an idle 2-core
CPU (backbone SFT 62 s, accuracy RM 410 s, refusal RM 13 s). With the wrong numbers of an
earlier `wrong_answer` that never erred in the units digit of an LSB-first answer: 0.963 / 0.92
(one thread: 0.971 / 0.932 after 400 steps, 0.954 / 0.90 after 300).
Without the auxiliary terms the same backbone reached 0.875 overall, 0.77 on "number" pairs, and
neither 700 steps, other learning rates, 2 extra fresh layers, a frozen backbone, nor a fresh RM
of the policy's size trained on 80k pairs got past 0.81 there: a single wrong digit is only
seen at EOS, where comparing it with the digit the backbone would have written takes a hop these
models do not learn from the pairwise loss alone. "number" accuracy after 64k pairs (one
thread, lr 1e-3, batch 64, number pairs only): fresh 0.83, fresh + both terms 0.87, SFT
backbone + both terms 0.92; the divergence term alone did not help (0.73 after 32k pairs vs
0.75 without). "fresh": 0.859 / 0.843 overall (seeds 0, 1), 0.67 / 0.64 on "number" pairs, 1.00
on the other kinds; about 30 s.
Ranking π0's own mistakes is what GRPO needs, and random held-out pairs overstate it: on π0's
wrong samples for 400 held-out prompts (1719 pairs) the 0.953 RM above is right on 0.822 of
pairs, and ranks the answer above every wrong sample for 0.466 of prompts; GRPO on it moved the
greedy held-out accuracy from 0.364 to 0.292 in 300 steps. With `policy=π0` (half of the
training pairs π0's mistakes on training prompts): 0.976 on the builtin held-out pairs, 0.946 on
"number" pairs, 0.873 / 0.571 on π0's held-out mistakes; GRPO 0.364 -> 0.383 in 300 steps. The
whole `demo --rewards rm` (seed 0, 400 steps): RMs 0.970 / 0.999 held out, accuracy 0.364 ->
0.279, refusal recall 0.265 -> 1.000, 14 min 11 s: the RM is still not good enough.
A backbone that already does the arithmetic does not help (measured 2026-12-01, same recipe and
π0): the default 800-step backbone answers only 0.084 of the held-out prompts right when sampled
greedily, one SFT'd 1600 steps (lr 1e-3 or 2e-3, 150 s) answers 1.000, yet the accuracy RM on it
reaches only 0.907 held out (0.79 "number"; 0.741 of pairs and 0.378 of prompts on π0's mistakes).
Two extra zero-initialised layers on top of that backbone, frozen (depth to compare each written
digit with the previous position's prediction): 0.938 / 0.86, 0.80 / 0.46 on π0's mistakes, and
no better on the training prompts whose mistakes it was trained on (0.803 of pairs) than on other
training prompts (0.810): these RMs underfit, they do not memorize.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any, Callable

from grpolab.train.reward_model import (
    TINY_BASE,
    build_reward_model,
    pair_margins,
    save_reward_model,
    score_stats,
    torch_threads,
    train_reward_model,
)

DEMO_RM_SIZE = {"hidden_size": 64, "num_layers": 2, "num_heads": 4}
"""Size of a "fresh" demo reward model (builtin:tiny): about 0.1M parameters."""
DEMO_BACKBONE_SIZE = {"hidden_size": 128, "num_layers": 4, "num_heads": 4}
"""Size of the SFT backbone (builtin:tiny, about 0.86M parameters): the demo policy's size."""
DEMO_BACKBONE_SFT = {"steps": 800, "batch_size": 64, "lr": 1e-3, "refusal_share": 0.1}
"""SFT of the backbone: steps of `batch_size` fresh training-side examples, `refusal_share` of
them refusals of unanswerable prompts (all kinds)."""
DEMO_RM_RECIPES = {
    "sft": {
        "accuracy_rm": {"steps": 400, "batch_size": 256, "lr": 2e-3, "lm_coef": 1.0, "divergence_coef": 1.0,
                        "policy_share": 0.5, "policy_prompts": 6000},
        "refusal_rm": {"steps": 100, "batch_size": 32, "lr": 3e-4},
    },
    "fresh": {
        "accuracy_rm": {"steps": 600, "batch_size": 32, "lr": 2e-3},
        "refusal_rm": {"steps": 300, "batch_size": 32, "lr": 2e-3},
    },
}
"""Training of each demo RM per backbone: optimizer steps, pairs per step, peak learning rate
(warmup then cosine), the auxiliary loss weights of train_reward_model (0 when absent), and, when
a policy is given, the share of training pairs that are its own mistakes (`policy_wrong_pairs`
on up to `policy_prompts` prompts, cycled; the rest are `accuracy_pairs`)."""


def sft_backbone(
    task,
    tokenizer,
    *,
    seed: int = 0,
    steps: int = DEMO_BACKBONE_SFT["steps"],
    batch_size: int = DEMO_BACKBONE_SFT["batch_size"],
    lr: float = DEMO_BACKBONE_SFT["lr"],
    refusal_share: float = DEMO_BACKBONE_SFT["refusal_share"],
    size: dict[str, int] | None = None,
):
    """A fresh builtin:tiny causal LM (`size`, default DEMO_BACKBONE_SIZE), SFT'd on `steps *
    batch_size` examples from the task's TRAINING side (`task.sft_examples`: clean answers, and
    `refusal_share` of them REFUSAL for unanswerable prompts of every kind). Each example is used
    once. Held-out (eval-side) facts are never seen. Returns the LM in eval mode."""
    from grpolab.models.tiny import build_tiny_model
    from grpolab.train.sft import train_sft

    if steps < 1 or batch_size < 1:
        raise ValueError(f"sft_backbone: steps and batch_size must be >= 1, got {steps}, {batch_size}")
    lm = build_tiny_model(tokenizer, seed=seed, **(size or DEMO_BACKBONE_SIZE))
    examples = task.sft_examples(random.Random(f"{seed}:backbone"), steps * batch_size,
                                 refusal_examples=float(refusal_share))
    train_sft(lm, tokenizer, examples, steps=steps, batch_size=batch_size, microbatch_size=batch_size,
              lr=lr, seed=seed)
    return lm.eval()


def policy_wrong_pairs(policy, tokenizer, task, *, prompts: int, group_size: int = 8, seed: int = 0,
                       max_new_tokens: int = 8):
    """Accuracy pairs whose rejected side is the policy's own mistake: for (up to) `prompts`
    answerable prompts of the task's TRAINING side, `group_size` sampled completions each (temperature 1);
    every distinct completion that is not the answer gives PrefPair(prompt, answer, completion).
    These are the near misses a GRPO run on this policy will explore. Returns a list of PrefPair."""
    import torch

    from grpolab.data.preferences import PrefPair
    from grpolab.rollout.hf import HFEngine, decode_completions

    rng = random.Random(f"{seed}:policy_pairs")  # up to `prompts`: fewer if the task is mostly unanswerable
    items = [it for it in task.train_prompts(rng, 4 * prompts) if it.meta["answerable"]][:prompts]
    engine, gen = HFEngine(tokenizer, max_new_tokens), torch.Generator().manual_seed(seed)
    pairs = []  # HFEngine.generate runs without grad
    for start in range(0, len(items), 256):
        chunk = items[start : start + 256]
        texts = decode_completions(tokenizer, engine.generate_with(policy, [it.prompt for it in chunk], group_size,
                                                              generator=gen))
        for i, it in enumerate(chunk):
            answer = it.meta["answer"]
            wrong = sorted(set(texts[i * group_size : (i + 1) * group_size]) - {answer})
            pairs += [PrefPair(it.prompt, answer, w) for w in wrong if w.strip()]
    return pairs


def _recipes(backbone: str, steps, batch_size: int | None, lr: float | None) -> dict[str, dict[str, Any]]:
    """DEMO_RM_RECIPES[backbone] with the caller's overrides (steps: int or per-RM dict)."""
    plan = {key: dict(recipe) for key, recipe in DEMO_RM_RECIPES[backbone].items()}
    if isinstance(steps, dict):
        unknown = sorted(set(steps) - set(plan))
        if unknown:
            raise ValueError(f"build_demo_reward_models: steps has unknown keys {unknown}; use {sorted(plan)}")
    for key, recipe in plan.items():
        if steps is not None:
            recipe["steps"] = steps.get(key, recipe["steps"]) if isinstance(steps, dict) else steps
        recipe.update({k: v for k, v in (("batch_size", batch_size), ("lr", lr)) if v is not None})
    return plan


def build_demo_reward_models(
    task,
    tokenizer,
    out_dir: str | Path,
    *,
    seed: int = 0,
    backbone: str = "sft",
    steps: int | dict[str, int] | None = None,
    batch_size: int | None = None,
    lr: float | None = None,
    heldout_pairs: int = 1000,
    base: Any = TINY_BASE,
    sft: dict[str, Any] | None = None,
    num_threads: int | None = None,
    progress: Callable[[str], None] | None = None,
    policy: Any = None,
) -> dict[str, dict[str, Any]]:
    """Trains and saves the accuracy RM and the refusal RM of the built-in arithmetic task.

    backbone: "sft" (default: both RMs start from `sft_backbone(task, ...)`, trained once; `base`
        must then be left at its default) or "fresh" (each RM starts from `base`: "builtin:tiny" at
        DEMO_RM_SIZE, or a causal LM whose backbone initializes both, e.g. π0).
    Each RM is trained as DEMO_RM_RECIPES[backbone] says, on `steps * batch_size` fresh pairs from
    the task's TRAIN side (grpolab.data.preferences.accuracy_pairs / refusal_pairs), evaluated on
    `heldout_pairs` pairs from its EVAL side, and saved to out_dir/rm_accuracy and out_dir/rm_refusal.
    steps (an int for both, or {"accuracy_rm": n, "refusal_rm": m}), batch_size, lr: override the
        recipe. sft: with backbone="sft", overrides of DEMO_BACKBONE_SFT (steps, batch_size, lr,
        refusal_share) and "size".
    num_threads: torch threads while training (restored after); None keeps the current setting.
    progress: called with one line of text per stage (e.g. `Progress.log`).
    policy: the causal LM that GRPO will train (π0), or None. With it, `policy_share` of the accuracy
        RM's training pairs (recipe) reject the policy's own sampled mistakes on training prompts.
    Returns {"accuracy_rm": {"path", "heldout_accuracy", "margin", "by_kind", "seconds"},
    "refusal_rm": {...}}; by_kind: held-out accuracy per `builtin_pair_kind`; "seconds" of the
    accuracy RM include the backbone's SFT.
    The module docstring says what these recipes reach.
    """
    if backbone not in DEMO_RM_RECIPES:
        raise ValueError(f"build_demo_reward_models: backbone must be 'sft' or 'fresh', got {backbone!r}")
    if backbone == "sft" and not (isinstance(base, str) and base == TINY_BASE):
        raise ValueError("build_demo_reward_models: base applies only to backbone='fresh'")
    if backbone != "sft" and sft:
        raise ValueError("build_demo_reward_models: sft settings apply only to backbone='sft'")
    plan = _recipes(backbone, steps, batch_size, lr)
    out: dict[str, dict[str, Any]] = {}
    t0 = time.perf_counter()
    init: Any = base
    if backbone == "sft":
        with torch_threads(num_threads):
            init = sft_backbone(task, tokenizer, seed=seed, **(sft or {}))
        if progress is not None:
            progress(f"[rm] SFT backbone trained on the task's training side ({time.perf_counter() - t0:.0f} s)")
    for offset, key in enumerate(("accuracy_rm", "refusal_rm")):
        out[key] = _train_one(task, tokenizer, out_dir, key, init, plan[key], seed=seed, offset=offset,
                              heldout_pairs=heldout_pairs, num_threads=num_threads, backbone=backbone,
                              policy=policy)
        out[key]["seconds"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        if progress is not None:
            r = out[key]
            kinds_txt = ", ".join(f"{k} {v:.2f}" for k, v in r["by_kind"].items())
            progress(f"[rm] {key.split('_')[0]}: held-out pairwise accuracy {r['heldout_accuracy']:.3f} "
                     f"({kinds_txt}), margin {r['margin']:.2f}, {heldout_pairs} pairs, {r['seconds']:.0f} s")
    return out


def _training_pairs(task, tokenizer, key: str, make: Callable, recipe: dict[str, Any], rng: random.Random,
                    share: float, *, seed: int, policy: Any, num_threads: int | None) -> list:
    """The RM `key`'s training pairs: `make`'s builtin pairs, `share` of them the policy's mistakes."""
    n = recipe["steps"] * recipe["batch_size"]
    n_policy = round(n * share)
    mistakes = []
    if n_policy:
        prompts = min(recipe["policy_prompts"], n_policy)  # never more prompts than pairs needed
        with torch_threads(num_threads):
            mistakes = policy_wrong_pairs(policy, tokenizer, task, prompts=prompts, seed=seed)
    train = make(task, rng, n - (n_policy if mistakes else 0), split="train")
    if mistakes:
        train += [mistakes[i % len(mistakes)] for i in range(n_policy)]
        random.Random(f"{seed}:{key}:mix").shuffle(train)
    return train


def _train_one(task, tokenizer, out_dir, key: str, init: Any, recipe: dict[str, Any], *, seed: int,
               offset: int, heldout_pairs: int, num_threads: int | None, backbone: str,
               policy: Any = None) -> dict[str, Any]:
    """Trains, evaluates and saves one demo RM; returns its result dict (without "seconds")."""
    from grpolab.data.preferences import accuracy_pairs, builtin_pair_kind, refusal_pairs

    make = accuracy_pairs if key == "accuracy_rm" else refusal_pairs
    rng = random.Random(f"{seed}:{key}")
    steps, batch_size = recipe["steps"], recipe["batch_size"]
    heldout = make(task, random.Random(f"{seed}:{key}:heldout"), heldout_pairs, split="eval")
    share = recipe.get("policy_share", 0.0) if policy is not None else 0.0
    train = _training_pairs(task, tokenizer, key, make, recipe, rng, share, seed=seed, policy=policy,
                            num_threads=num_threads)
    tiny = DEMO_RM_SIZE if isinstance(init, str) and init == TINY_BASE else {}
    with torch_threads(num_threads):
        model = build_reward_model(init, tokenizer, seed=seed + offset, **tiny)
        train_reward_model(model, tokenizer, train, steps=steps, batch_size=batch_size,
                           microbatch_size=batch_size, lr=recipe["lr"], seed=seed + offset,
                           lm_coef=recipe.get("lm_coef", 0.0), divergence_coef=recipe.get("divergence_coef", 0.0))
        diff = pair_margins(model, tokenizer, heldout)
        mean, std = score_stats(model, tokenizer, train)
    kinds = [builtin_pair_kind(p) for p in heldout]
    by_kind = {k: float((diff[[i for i, x in enumerate(kinds) if x == k]] > 0).float().mean())
               for k in sorted(set(kinds))}
    acc, margin = float((diff > 0).float().mean()), float(diff.mean())
    name = key.split("_")[0]
    base_txt = "sft:builtin:tiny" if backbone == "sft" else str(init if isinstance(init, str) else "causal_lm")
    info = {"score_mean": mean, "score_std": std, "data": f"builtin:{name}", "base": base_txt,
            "heldout_accuracy": acc, "heldout_margin": margin, "heldout_by_kind": by_kind,
            "train_pairs": len(train), "heldout_pairs": len(heldout), "steps": steps,
            "lm_coef": recipe.get("lm_coef", 0.0), "divergence_coef": recipe.get("divergence_coef", 0.0),
            "policy_share": share}
    path = save_reward_model(model, tokenizer, Path(out_dir) / f"rm_{name}", info=info)
    return {"path": str(path), "heldout_accuracy": acc, "margin": margin, "by_kind": by_kind}
