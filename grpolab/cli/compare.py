"""`grpolab compare RUN_DIR...`: overlay the curves of several runs."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    c = subparsers.add_parser("compare", help="overlay the curves of several runs")
    c.add_argument("run_dirs", nargs="+")
    c.add_argument("--out", default="compare.html")
    c.set_defaults(fn=run)
    return c


def run(args) -> int:
    from grpolab.report.compare import write_compare

    print(write_compare(args.run_dirs, args.out))
    return 0
