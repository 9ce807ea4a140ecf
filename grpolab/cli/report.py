"""`grpolab report RUN_DIR`: write RUN_DIR/report.html."""

from __future__ import annotations

import argparse

from grpolab.cli.common import named_errors


def add_parser(subparsers) -> argparse.ArgumentParser:
    r = subparsers.add_parser("report", help="write RUN_DIR/report.html")
    r.add_argument("run_dir")
    r.set_defaults(fn=run)
    return r


def run(args) -> int:
    return named_errors(_run, args)


def _run(args) -> int:
    from grpolab.report.html import write_report

    print(write_report(args.run_dir))
    return 0
