"""Sharpening on the built-in task: greedy vs best-of-N by self-likelihood, on π0 and after SFT-sharpening.

    python bench/sharpening.py                      # the demo's π0 (built, ~2 min), N=16, 256 held-out prompts
    python bench/sharpening.py --quick              # N=8, 128 held-out prompts, 256 sharpening prompts
    python bench/sharpening.py --pi0 runs/demo-x/pi0 --n 8 --threads 1

π0 is the demo's (grpolab.app.demo: `demo_config()`, `build_pi0`: SFT stopped at 0.35 training-side probe
accuracy), built into OUT/pi0 once and reused, or --pi0. SFT-sharpening is `grpolab sharpen` on
that π0 (in process: best-of-N by log π0(y|x) on --prompts training prompts, then SFT), into
OUT/sharpened. Both models are evaluated on the held-out prompts (`arith_eval_items`) with
`evaluation.best_of_n.best_of_n_eval`: greedy, best-of-N where each model ranks its own N samples by its own
sequence log-likelihood (sum, and mean per token), the mean accuracy of one sample (pass@1) and
pass@N. Accuracy is the demo's: exact answer on answerable prompts. Sampling at temperature 1.
Writes OUT/sharpening.json and prints one table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grpolab.cli.sharpen import add_parser  # noqa: E402
from grpolab.data.build import arith_eval_items  # noqa: E402
from grpolab.app.demo import DEMO_OVERRIDES, build_pi0, demo_config  # noqa: E402
from grpolab.models.loading import load_model  # noqa: E402
from grpolab.rollout.hf import HFEngine  # noqa: E402
from grpolab.rewards.registry import build_rewards  # noqa: E402
from grpolab.evaluation.best_of_n import best_of_n_eval  # noqa: E402


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def pi0_folder(args, out: Path) -> Path:
    """--pi0, or the demo's π0 built into OUT/pi0 (reused when already there)."""
    if args.pi0:
        return Path(args.pi0)
    folder = out / "pi0"
    if not (folder / "config.json").is_file():
        say(f"[bench] building the demo's π0 into {folder}")
        build_pi0(demo_config(seed=args.seed), out)
    return folder


def sharpen(args, pi0: Path, out: Path) -> Path:
    """`grpolab sharpen` (the demo's config, π0 = `pi0`) into OUT/sharpened; returns its final/."""
    folder = out / "sharpened"
    argv = ["sharpen", "grpo_no_kl", *DEMO_OVERRIDES, f"model.name_or_path={pi0}", f"train.seed={args.seed}",
            f"sft.steps={args.sft_steps}", f"sft.lr={args.sft_lr}", "sft.batch_size=64", "sft.microbatch_size=64",
            "--n", str(args.n), "--prompts", str(args.prompts), "--out", str(folder), "--overwrite"]
    parser = argparse.ArgumentParser(prog="grpolab")
    add_parser(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(argv)
    if ns.fn(ns) != 0:
        raise SystemExit("grpolab sharpen failed")
    return folder / "final"


def evaluate(path: Path, args, cfg, items) -> dict:
    """best_of_n_eval of one model, ranked by its own summed and mean log-likelihood (same samples: same seed)."""
    model, tok = load_model(str(path))
    engine = HFEngine(tok, cfg.rollout.max_new_tokens)
    rewards = build_rewards(cfg)
    out = {}
    for name, norm in (("sum", False), ("mean", True)):
        gen = torch.Generator().manual_seed(args.seed + 1)
        out[name] = best_of_n_eval(model, engine, items, rewards, args.n, gen, length_normalized=norm, arith=True)
    return out


def table(results: dict, n: int) -> str:
    lines = [f"{'model':<11}{'greedy':>8}{f'bo{n} sum':>9}{f'bo{n} mean':>10}{'pass@1':>8}{f'pass@{n}':>8}"
             f"{'greedy logp':>12}"]
    for name, r in results.items():
        s, m = r["sum"], r["mean"]
        lines.append(f"{name:<11}{s['greedy']['arith']['accuracy']:>8.3f}{s['best_of_n']['arith']['accuracy']:>9.3f}"
                     f"{m['best_of_n']['arith']['accuracy']:>10.3f}{s['sampled']['arith']['accuracy']:>8.3f}"
                     f"{s['sampled'][f'pass@{n}']:>8.3f}{s['greedy']['self_likelihood']:>12.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="N=8, 128 held-out prompts, 256 sharpening prompts")
    p.add_argument("--pi0", default="", help="π0 folder (default: build the demo's into OUT/pi0)")
    p.add_argument("--out", default="runs/bench-sharpening")
    p.add_argument("--n", type=int, default=None, help="best-of-N (default 16; 8 with --quick)")
    p.add_argument("--prompts", type=int, default=None, help="sharpening prompts (default 1024; 256 with --quick)")
    p.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts (default 256; 128 with --quick)")
    p.add_argument("--sft-steps", type=int, default=None, help="SFT steps on the winners (default 150; 50 --quick)")
    p.add_argument("--sft-lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    q = args.quick
    args.n = args.n or (8 if q else 16)
    args.prompts = args.prompts or (256 if q else 1024)
    args.sft_steps = args.sft_steps or (50 if q else 150)
    eval_prompts = args.eval_prompts or (128 if q else 256)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cfg = demo_config(seed=args.seed, overrides=[f"data.eval_prompts={eval_prompts}"])
    items = arith_eval_items(cfg)
    pi0 = pi0_folder(args, out)
    sharpened = sharpen(args, pi0, out)
    results = {}
    for name, path in (("pi0", pi0), ("sharpened", sharpened)):
        say(f"[bench] evaluating {name}: greedy and best-of-{args.n} on {len(items)} held-out prompts")
        results[name] = evaluate(path, args, cfg, items)
    payload = {"n": args.n, "eval_prompts": len(items), "answerable": sum(it.meta["answerable"] for it in items),
               "sharpen_prompts": args.prompts, "sft_steps": args.sft_steps, "sft_lr": args.sft_lr,
               "seed": args.seed, "results": results, "sharpen": json.loads((sharpened.parent / "sharpen.json").read_text()),
               "wall_s": time.perf_counter() - t0}
    (out / "sharpening.json").write_text(json.dumps(payload, indent=1))
    print(f"held-out accuracy (answerable prompts: {payload['answerable']} of {len(items)}), N = {args.n}, seed {args.seed}")
    print(table(results, args.n))
    print(f"({payload['wall_s']:.0f} s; {out / 'sharpening.json'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
