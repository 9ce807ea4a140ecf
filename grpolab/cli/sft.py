"""`grpolab sft [CONFIG] [overrides]`: supervised fine-tuning (token cross-entropy)."""

from __future__ import annotations

import argparse

from grpolab.cli.common import OVERWRITE_HELP, named_errors


def add_parser(subparsers) -> argparse.ArgumentParser:
    s = subparsers.add_parser("sft", help="supervised fine-tuning (token cross-entropy)")
    s.add_argument("config", nargs="?", default="", help="a YAML file or preset (default: sft)")
    s.add_argument("overrides", nargs="*")
    s.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    s.set_defaults(fn=run)
    return s


def run(args) -> int:
    return named_errors(_run, args)


def _run(args) -> int:
    from grpolab.api.runs import sft

    sft(args.config or "sft", args.overrides, overwrite=args.overwrite)
    return 0
