"""`grpolab sharpen`: SFT-sharpening (Huang et al. 2024): best-of-N by self-likelihood under π0, then
SFT on the winners.

    grpolab sharpen CONFIG|PRESET [key=value ...] --n 8 --out runs/sharp [--prompts 1024] [--length-normalized]

π0 is model.name_or_path (an HF folder, or a run directory with final/, e.g. a `grpolab sft` run).
The training prompts are the first --prompts of the config's prompt stream (data.source, seeded by
train.seed; the built-in task's training side). Each gets --n completions sampled as rollout.*
says (temperature, top_p, top_k, max_new_tokens); the one with the highest log π0(y|x) (sum over
its tokens and EOS, or their mean with --length-normalized) is its SFT target. SFT runs sft.steps
steps of sft.batch_size sequences (sft.microbatch_size per forward) at sft.lr.

DIR gets: final/ (the sharpened model and tokenizer), config.yaml, winners.jsonl (prompt, winner,
its score, truncated) and sharpen.json: the mean self-likelihood under π0 of π0's greedy
completions, of the winners and of the sharpened model's greedy completions, how often greedy
decoding gives the winner (before and after), the SFT losses.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _greedy_under(model, engine, scorer, items) -> tuple[list[str], float]:
    """`model`'s greedy completions of `items` and their mean self-likelihood under π0 (`scorer`)."""
    from grpolab.rewards.base import score_batch
    from grpolab.rollout.hf import generate_texts
    from grpolab.algo.metrics import nanmean

    prompts = [it.prompt for it in items]
    texts, trunc = generate_texts(model, engine, prompts, greedy=True)
    sl = score_batch(scorer, prompts, texts, [{**it.meta, "truncated": t} for it, t in zip(items, trunc)])
    return texts, nanmean(sl)


def _share_equal(a: list[str], b: list[str]) -> float:
    return sum(x == y for x, y in zip(a, b)) / max(len(a), 1)


def _write_winners(path: Path, items, best) -> None:
    with open(path, "w") as f:
        for it, text, score, tr in zip(items, best.texts, best.scores.tolist(), best.truncated.tolist()):
            f.write(json.dumps({"prompt": it.prompt, "winner": text, "self_likelihood": score, "truncated": tr}) + "\n")


def sharpen(config: str, overrides: list[str], *, n: int, out: str, prompts: int = 1024,
            length_normalized: bool = False, overwrite: bool = False) -> int:
    """`grpolab sharpen` (module docstring); returns the exit code."""
    import torch

    from grpolab.app.common import load_config
    from grpolab.parallel.launch import apply_threads
    from grpolab.data.build import prompt_stream
    from grpolab.rewards.self_likelihood import SelfLikelihood
    from grpolab.rollout.hf import HFEngine
    from grpolab.manifest import write_manifest
    from grpolab.rundir.rundir import claim, mark_finished, model_folder, write_config
    from grpolab.models.policy import load_policy
    from grpolab.sft.sharpen import sharpen_sft

    if n < 1 or prompts < 1:
        raise ValueError(f"--n={n} and --prompts={prompts} must both be >= 1")
    cfg = apply_threads(load_config(config, overrides))
    cfg = cfg.replace(**{"model.name_or_path": model_folder(cfg.model.name_or_path)})
    run_dir = claim(Path(out), "sharpen", overwrite=overwrite, field="--out", say=_say)
    write_config(cfg, run_dir)
    t0 = time.perf_counter()
    model, tok = load_policy(cfg)
    r, sc = cfg.rollout, cfg.sft
    engine = HFEngine(tok, r.max_new_tokens, r.temperature, r.top_p, r.top_k)
    items = prompt_stream(cfg, tok).next_batch(prompts)
    scorer = SelfLikelihood(model=model, tokenizer=tok, length_normalized=length_normalized)  # frozen π0
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(cfg.train.seed)
    _say(f"[sharpen] π0 {cfg.model.name_or_path}: best-of-{n} on {len(items)} prompts, then {sc.steps} SFT steps")

    def on_step(i: int, loss: float) -> None:
        if i == 0 or (i + 1) % 50 == 0:
            _say(f"[sharpen] SFT step {i + 1}/{sc.steps} loss {loss:.4f}")

    greedy0, before = _greedy_under(model, engine, scorer, items)
    res = sharpen_sft(model, engine, [it.prompt for it in items], n, scorer, steps=sc.steps,
                      batch_size=sc.batch_size, microbatch_size=sc.microbatch_size, lr=sc.lr, seed=cfg.train.seed,
                      generator=gen, on_step=on_step)
    greedy1, after = _greedy_under(model, engine, scorer, items)
    model.save_pretrained(run_dir / "final")
    tok.save_pretrained(run_dir / "final")
    write_manifest(run_dir / "final")
    _write_winners(run_dir / "winners.jsonl", items, res.best)
    summary = _summary(n, length_normalized, cfg, res, before, after, time.perf_counter() - t0)
    summary["greedy_equals_winner"] = {"pi0": _share_equal(greedy0, res.best.texts),
                                       "sharpened": _share_equal(greedy1, res.best.texts)}
    (run_dir / "sharpen.json").write_text(json.dumps(summary, indent=2))
    mark_finished(run_dir)
    sl = summary["self_likelihood_under_pi0"]
    print(f"mean log π0(y|x): π0 greedy {sl['pi0_greedy']:.4f}, best-of-{n} winners {sl['winners']:.4f}, "
          f"sharpened greedy {sl['sharpened_greedy']:.4f}; SFT loss {res.losses[0]:.4f} -> {res.losses[-1]:.4f}")
    print(f"run directory: {run_dir}")
    return 0


def _summary(n: int, length_normalized: bool, cfg, res, before: float, after: float, wall_s: float) -> dict:
    from grpolab.algo.metrics import nanmean

    best = res.best
    return {
        "n": n, "prompts": len(best.texts), "sft_pairs": len(res.pairs),
        "length_normalized": length_normalized, "pi0": cfg.model.name_or_path,
        "self_likelihood_under_pi0": {"pi0_greedy": before, "winners": nanmean(best.scores),
                                      "sampled": nanmean(best.candidate_scores.flatten()),
                                      "sharpened_greedy": after},
        "winners_truncated": int(best.truncated.sum()),
        "sft": {"steps": len(res.losses), "first_loss": res.losses[0], "final_loss": res.losses[-1],
                "batch_size": cfg.sft.batch_size, "lr": cfg.sft.lr},
        "wall_s": wall_s,
    }
