"""`grpolab export RUN_DIR --out DIR`: a run's policy as a standalone HF folder."""

from __future__ import annotations

import argparse

import sys

from grpolab.cli.common import OVERWRITE_HELP, named_errors


def add_parser(subparsers) -> argparse.ArgumentParser:
    x = subparsers.add_parser("export", help="a run's policy as a standalone HF folder (LoRA merged, tokenizer, "
                                             "generation config)")
    x.add_argument("run_dir")
    x.add_argument("--out", required=True, help="a new folder")
    x.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    x.add_argument("--step", type=int, default=None, help="a step checkpoint (default: the final policy)")
    x.set_defaults(fn=run)
    return x


def run(args) -> int:
    return named_errors(_run, args)


def _run(args) -> int:
    from grpolab.api.runs import export

    def say(msg: str) -> None:
        print(msg, file=sys.stderr)

    print(f"exported to {export(args.run_dir, args.out, step=args.step, overwrite=args.overwrite, say=say)}")
    return 0
