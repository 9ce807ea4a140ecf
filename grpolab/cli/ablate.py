"""`grpolab ablate`: presets of the spectrum side by side on the built-in task, equal budgets, several seeds.

    grpolab ablate                                     # the default variants, seeds 0,1,2, into runs/ablate
    grpolab ablate --presets reinforce,grpo --seeds 0,1 --steps 50 --out runs/abl train.lr=5e-5
    grpolab ablate --quick                             # 30 steps, seeds 0,1: a few minutes

Every variant starts from the same π0 per seed and generates the same number of completions
(P × G × steps); see grpolab/app/ablate.py for what is shared and what each variant keeps. OUT gets one
run directory per (variant, seed), ablate.json (the table) and ablate.html (curves with seed bands,
the table, a summary computed from the numbers). Finished runs are skipped when it runs again.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpolab.cli.common import named_errors


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Adds the `ablate` subcommand to an argparse subparsers object (sets fn=run)."""
    a = subparsers.add_parser("ablate", help="run presets side by side (equal generated completions, several seeds) "
                                             "and write one comparison report")
    a.add_argument("overrides", nargs="*", help="key=value overrides applied to every variant and π0, e.g. "
                   "rollout.prompts_per_step=8 (a variant's own values, e.g. rl_sharpening's rewards, win)")
    a.add_argument("--presets", default="", help="comma-separated variants: presets (onpolicy_sft, reinforce, ...) "
                   "and rl_sharpening, sft_sharpening (default: the spectrum, ppo when this grpolab has it, and both "
                   "sharpening variants)")
    a.add_argument("--seeds", default="", help="comma-separated seeds (default 0,1,2; --quick: 0,1)")
    a.add_argument("--steps", type=int, default=None, help="training steps of each run (default 100; --quick: 30)")
    a.add_argument("--out", default="runs/ablate", help="output folder (default runs/ablate)")
    a.add_argument("--jobs", type=int, default=2, help="runs at once, each in its own process with one torch "
                   "thread (default 2; 1 runs them in this process)")
    a.add_argument("--overwrite", action="store_true", help="when --out holds files grpolab ablate did not write "
                   "(or another command's run), move them aside (DIR.old-<time>; nothing is deleted)")
    a.add_argument("--quick", action="store_true", help="a short ablation: 30 steps, seeds 0,1")
    a.set_defaults(fn=run)
    return a


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated integers, got {text!r}") from None


def ablation(args, say=print):
    """The Ablation that args describe (ValueError naming the flag)."""
    from grpolab.app.ablate import DEFAULT_STEPS, QUICK_STEPS, Ablation, default_variants

    variants = tuple(v.strip() for v in args.presets.split(",") if v.strip()) or default_variants(say)
    seeds = _ints(args.seeds, "--seeds") or ((0, 1) if args.quick else (0, 1, 2))
    steps = args.steps if args.steps is not None else (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    return Ablation(out=Path(args.out).resolve(), variants=variants, seeds=seeds, steps=steps,
                    overrides=tuple(args.overrides), jobs=args.jobs, threads=1 if args.jobs > 1 else 0,
                    overwrite=args.overwrite)


def _ablate(args) -> int:
    from grpolab.app.ablate import run_ablation

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    data = run_ablation(ablation(args, say), say)
    if data["failed"]:
        print(f"grpolab ablate: {len(data['failed'])} run(s) failed (see above); run the same command again to "
              "retry them", file=sys.stderr)
        return 1
    return 0


def run(args) -> int:
    """Runs `grpolab ablate`; bad input ends with one line naming the culprit (GRPOLAB_DEBUG=1: traceback)."""
    return named_errors(_ablate, args)
