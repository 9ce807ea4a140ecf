"""`grpolab rm --data DATA --out DIR`: train a reward model on preference pairs (grpolab/app/rm.py)."""

from __future__ import annotations

import argparse
import os
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Adds the `rm` subcommand to an argparse subparsers object (sets fn=run)."""
    from grpolab.app.rm import add_arguments

    r = subparsers.add_parser("rm", help="train a reward model on preference pairs (pairwise log-sigmoid loss)")
    add_arguments(r)
    r.set_defaults(fn=run)
    return r


def run(args) -> int:
    """Runs `grpolab rm`; bad input ends with one line naming the culprit (GRPOLAB_DEBUG=1: traceback)."""
    from grpolab.api.runs import train_rm

    options = {k: v for k, v in vars(args).items()
               if k not in ("command", "fn", "command_parser", "argv", "main", "data", "out", "base", "eval_data",
                            "overwrite")}
    try:
        train_rm(args.data, args.out, base=args.base, eval_data=args.eval_data, overwrite=args.overwrite, **options)
        return 0
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        if os.environ.get("GRPOLAB_DEBUG"):
            raise
        print(f"grpolab rm: error: {e}", file=sys.stderr)
        return 2
