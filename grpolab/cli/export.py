"""`grpolab export RUN_DIR --out DIR`: a run's policy as a standalone HF folder."""

from __future__ import annotations

import argparse

from grpolab.cli.common import named_errors


def add_parser(subparsers) -> argparse.ArgumentParser:
    x = subparsers.add_parser("export", help="a run's policy as a standalone HF folder (LoRA merged, tokenizer, "
                                             "generation config)")
    x.add_argument("run_dir")
    x.add_argument("--out", required=True, help="a new folder")
    x.add_argument("--step", type=int, default=None, help="a step checkpoint (default: the final policy)")
    x.set_defaults(fn=run)
    return x


def run(args) -> int:
    return named_errors(_run, args)


def _run(args) -> int:
    from grpolab.rundir.export import export_run

    print(f"exported to {export_run(args.run_dir, args.out, args.step)}")
    return 0
