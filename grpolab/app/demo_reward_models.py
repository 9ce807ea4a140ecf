"""The demo's two reward models (accuracy and refusal) for the built-in arithmetic task.

Two backbones (`build_demo_reward_models(backbone=...)`):
- "sft" (default): as reward models usually are, both RMs start from an SFT'd causal LM. A tiny LM
  (`DEMO_BACKBONE_SIZE`) is first SFT'd on the task's TRAINING side only (fresh examples each step,
  clean answers, plus refusals for unanswerable prompts), until it does the arithmetic; each RM is
  then that backbone with a new score head, fine-tuned on preference pairs. The accuracy RM adds two
  auxiliary terms to the pairwise loss (`lm_coef`, `divergence_coef` of train_reward_model): the
  LM loss on the chosen completion keeps the backbone computing the answer, and the pairwise loss
  at the first token where chosen and rejected part puts the signal on the digit that is wrong:
  a single wrong digit is otherwise seen only at EOS, which these small models learn poorly from
  the pairwise loss alone.
- "fresh": each RM is a fresh `DEMO_RM_SIZE` tiny model trained on pairs only: much faster, good
  on every kind of pair but "number" pairs (the right answer vs another integer).

Ranking the policy's own mistakes is what GRPO needs, and random held-out pairs overstate it:
`policy=π0` makes half of the accuracy RM's training pairs reject π0's own sampled mistakes on
training prompts.
"""

from __future__ import annotations

import functools
import random
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import torch

from grpolab.reward_models.model import TINY_BASE, build_reward_model, save_reward_model
from grpolab.reward_models.training import pair_margins, pair_scores, fit_calibration, score_stats, train_reward_model

DEMO_RM_SIZE = {"hidden_size": 64, "num_layers": 2, "num_heads": 4}
"""Size of a "fresh" demo reward model (builtin:tiny): about 0.1M parameters."""
DEMO_BACKBONE_SIZE = {"hidden_size": 128, "num_layers": 4, "num_heads": 4}
"""Size of the SFT backbone (builtin:tiny, about 0.86M parameters): the demo policy's size."""
DEMO_BACKBONE_SFT = {"steps": 800, "batch_size": 64, "lr": 1e-3, "refusal_share": 0.1}
"""SFT of the backbone: steps of `batch_size` fresh training-side examples, `refusal_share` of
them refusals of unanswerable prompts (all kinds)."""
DEMO_RM_RECIPES = {
    "sft": {
        "accuracy_rm": {"steps": 250, "batch_size": 256, "lr": 2e-3, "lm_coef": 1.0, "divergence_coef": 1.0,
                        "policy_share": 0.5, "policy_prompts": 6000},
        "refusal_rm": {"steps": 100, "batch_size": 32, "lr": 3e-4},
        "accuracy_rm_process": {"kind": "process", "step_scorer": "lm", "steps": 100, "batch_size": 256,
                                "lr": 3e-4, "policy_share": 0.5, "policy_prompts": 6000},
    },
    "fresh": {
        "accuracy_rm": {"steps": 600, "batch_size": 32, "lr": 2e-3},
        "refusal_rm": {"steps": 300, "batch_size": 32, "lr": 2e-3},
    },
}
"""Training of each demo RM per backbone: optimizer steps, pairs per step, peak learning rate
(warmup then cosine), the auxiliary loss weights of train_reward_model (0 when absent), and, when
a policy is given, the share of training pairs that are its own mistakes (`policy_wrong_pairs`
on up to `policy_prompts` prompts, cycled; the rest are `accuracy_pairs`). `accuracy_rm_process`:
the process accuracy RM (`accuracy="process"`), trained on both completions of each of its pairs,
every step labelled against the chosen (gold) one (reward_models/process.py)."""
ACCURACY_RMS = ("outcome", "process", "ensemble")
PROCESS_BACKBONE_STEPS = 1600
"""SFT steps of the backbone under a process accuracy RM (`accuracy="process"`): long enough that the
backbone does the task's arithmetic, which its language model then checks step by step."""


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
    from grpolab.sft.sft import train_sft

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
    accuracy: str = "outcome",
    ensemble_size: int = 3,
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
    accuracy: the accuracy RM: "outcome" (pairwise, one score at EOS), "process" (a score per
        step, the weakest one counts; recipe accuracy_rm_process) or "ensemble" (`ensemble_size`
        outcome RMs of different seeds, out_dir/rm_accuracy_K; its entry has "paths", and held-out
        accuracy / margin / by_kind of their mean normalized score).
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
    if accuracy not in ACCURACY_RMS or (accuracy == "process" and backbone != "sft") or ensemble_size < 2:
        raise ValueError(f"build_demo_reward_models: accuracy must be one of {ACCURACY_RMS} (process with the "
                         f"sft backbone) and ensemble_size >= 2; got {accuracy!r}, {backbone!r}, {ensemble_size}")
    plan = _recipes(backbone, steps, batch_size, lr)
    out: dict[str, dict[str, Any]] = {}
    t0 = time.perf_counter()
    init: Any = base
    if backbone == "sft":
        sft = {"steps": PROCESS_BACKBONE_STEPS, **(sft or {})} if accuracy == "process" else sft
        with torch_threads(num_threads):
            init = sft_backbone(task, tokenizer, seed=seed, **(sft or {}))
        if progress is not None:
            progress(f"[rm] SFT backbone trained on the task's training side ({time.perf_counter() - t0:.0f} s)")
    common = dict(heldout_n=heldout_pairs, num_threads=num_threads, backbone=backbone, policy=policy)
    for offset, key in enumerate(("accuracy_rm", "refusal_rm")):
        if key == "accuracy_rm" and accuracy == "ensemble":
            out[key] = _train_ensemble(task, tokenizer, out_dir, init, plan[key], ensemble_size, seed=seed, **common)
        else:
            recipe = plan["accuracy_rm_process"] if key == "accuracy_rm" and accuracy == "process" else plan[key]
            out[key] = _train_one(task, tokenizer, out_dir, key, init, recipe, seed=seed, offset=offset, **common)
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


def heldout_pairs(task, key: str, seed: int, n: int = 1000) -> list:
    """The held-out pairs (task's EVAL side) the demo RM `key` (accuracy_rm / refusal_rm) is measured on."""
    from grpolab.data.preferences import accuracy_pairs, refusal_pairs

    make = accuracy_pairs if key == "accuracy_rm" else refusal_pairs
    return make(task, random.Random(f"{seed}:{key}:heldout"), n, split="eval")


def _train_one(task, tokenizer, out_dir, key: str, init: Any, recipe: dict[str, Any], *, seed: int,
               offset: int, heldout_n: int, num_threads: int | None, backbone: str,
               policy: Any = None, folder: str | None = None) -> dict[str, Any]:
    """Trains, evaluates and saves one demo RM (out_dir/`folder`, default rm_accuracy / rm_refusal);
    returns its result dict (without "seconds"). recipe["kind"] == "process": a process RM trained
    on both completions of each pair, checked against the chosen one."""
    from grpolab.data.preferences import accuracy_pairs, refusal_pairs

    make = accuracy_pairs if key == "accuracy_rm" else refusal_pairs
    rng = random.Random(f"{seed}:{key}")
    steps, batch_size = recipe["steps"], recipe["batch_size"]
    heldout = heldout_pairs(task, key, seed, heldout_n)
    share = recipe.get("policy_share", 0.0) if policy is not None else 0.0
    train = _training_pairs(task, tokenizer, key, make, recipe, rng, share, seed=seed, policy=policy,
                            num_threads=num_threads)
    tiny = DEMO_RM_SIZE if isinstance(init, str) and init == TINY_BASE else {}
    process = recipe.get("kind") == "process"
    with torch_threads(num_threads):
        model = build_reward_model(init, tokenizer, seed=seed + offset, **tiny)
        if process:
            from grpolab.reward_models.process import StepExample, score_process, train_process_rm

            scorer = recipe.get("step_scorer", "head")
            examples = [StepExample(p.prompt, c, p.chosen) for p in train for c in (p.chosen, p.rejected)]
            train_process_rm(model, tokenizer, examples, steps=steps, batch_size=2 * batch_size, lr=recipe["lr"],
                             seed=seed + offset, scorer=scorer)
            score = functools.partial(score_process, scorer=scorer)
            sc = pair_scores(model, tokenizer, heldout, score)
            diff = sc[: len(heldout)] - sc[len(heldout):]
        else:
            score = None  # score_texts: the score at EOS
            train_reward_model(model, tokenizer, train, steps=steps, batch_size=batch_size,
                               microbatch_size=batch_size, lr=recipe["lr"], seed=seed + offset,
                               lm_coef=recipe.get("lm_coef", 0.0), divergence_coef=recipe.get("divergence_coef", 0.0))
            diff = pair_margins(model, tokenizer, heldout)
        mean, std = score_stats(model, tokenizer, train, scorer=score)
        calib = fit_calibration(model, tokenizer, train, scorer=score)
    acc, margin, by_kind = _heldout_summary(heldout, diff)
    name = key.split("_")[0]
    base_txt = "sft:builtin:tiny" if backbone == "sft" else str(init if isinstance(init, str) else "causal_lm")
    info = {"score_mean": mean, "score_std": std, "calibration": calib, "data": f"builtin:{name}", "base": base_txt,
            "heldout_accuracy": acc, "heldout_margin": margin, "heldout_by_kind": by_kind,
            "train_pairs": len(train), "heldout_pairs": len(heldout), "steps": steps,
            "lm_coef": recipe.get("lm_coef", 0.0), "divergence_coef": recipe.get("divergence_coef", 0.0),
            "policy_share": share, **({"kind": "process", "step_scorer": scorer} if process else {})}
    path = save_reward_model(model, tokenizer, Path(out_dir) / (folder or f"rm_{name}"), info=info, pairs=train)
    return {"path": str(path), "heldout_accuracy": acc, "margin": margin, "by_kind": by_kind}


def _heldout_summary(heldout: list, diff) -> tuple[float, float, dict[str, float]]:
    """(accuracy, mean margin, accuracy per builtin_pair_kind) of s_chosen - s_rejected `diff`."""
    from grpolab.data.preferences import builtin_pair_kind

    kinds = [builtin_pair_kind(p) for p in heldout]
    by_kind = {k: float((diff[[i for i, x in enumerate(kinds) if x == k]] > 0).float().mean())
               for k in sorted(set(kinds))}
    return float((diff > 0).float().mean()), float(diff.mean()), by_kind


def _train_ensemble(task, tokenizer, out_dir, init: Any, recipe: dict[str, Any], size: int, *, seed: int,
                    **common) -> dict[str, Any]:
    """`size` accuracy RMs (seeds seed + 100·k: head, data and order differ), out_dir/rm_accuracy_k;
    held-out figures of their mean normalized score (what reward_model_ensemble mode=mean ranks by)."""
    import torch

    from grpolab.rewards.reward_model import RewardModelReward

    paths = [_train_one(task, tokenizer, out_dir, "accuracy_rm", init, recipe, seed=seed + 100 * k, offset=0,
                        folder=f"rm_accuracy_{k}", **common)["path"] for k in range(size)]
    heldout = heldout_pairs(task, "accuracy_rm", seed, common["heldout_n"])
    prompts = [p.prompt for p in heldout] * 2
    texts = [p.chosen for p in heldout] + [p.rejected for p in heldout]
    sc = torch.stack([torch.tensor(RewardModelReward(p, normalize="fixed")(prompts, texts, [{}] * len(texts)))
                      for p in paths]).mean(0)
    acc, margin, by_kind = _heldout_summary(heldout, sc[: len(heldout)] - sc[len(heldout):])
    return {"path": paths[0], "paths": paths, "heldout_accuracy": acc, "margin": margin, "by_kind": by_kind}


@contextmanager
def torch_threads(n: int | None):
    """Sets torch's intra-op thread count for the block (None: unchanged), then restores it."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
