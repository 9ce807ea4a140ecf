"""`grpolab sharpen CONFIG|PRESET --n N --out DIR`: SFT-sharpening (grpolab/app/sharpen.py)."""

from __future__ import annotations

import argparse

from grpolab.cli.common import named_errors


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Adds the `sharpen` subcommand to an argparse subparsers object (sets fn=run)."""
    s = subparsers.add_parser("sharpen", help="SFT-sharpening: best-of-N by self-likelihood under π0, then SFT "
                                              "on the winners")
    s.add_argument("config", help="a YAML file or a preset name: model.name_or_path is π0; data, rollout, sft")
    s.add_argument("overrides", nargs="*", help="key=value overrides, e.g. sft.steps=200")
    s.add_argument("--n", type=int, required=True, help="completions sampled per prompt (best-of-N)")
    s.add_argument("--out", required=True, help="output folder (final/, sharpen.json, winners.jsonl)")
    s.add_argument("--prompts", type=int, default=1024, help="training prompts to sharpen on (default 1024)")
    s.add_argument("--length-normalized", action="store_true",
                   help="rank by the mean token log-prob instead of the sum (no preference for short completions)")
    s.add_argument("--overwrite", action="store_true",
                   help="when --out holds a run, move it aside (OUT.old-<time>; nothing is deleted)")
    s.set_defaults(fn=run)
    return s


def run(args) -> int:
    """Runs `grpolab sharpen`; bad input ends with one line naming the culprit (GRPOLAB_DEBUG=1: traceback)."""
    return named_errors(_run, args)


def _run(args) -> int:
    from grpolab.app.sharpen import sharpen

    return sharpen(args.config, args.overrides, n=args.n, out=args.out, prompts=args.prompts,
                   length_normalized=args.length_normalized, overwrite=args.overwrite)
