"""`grpolab data [CONFIG] --out DIR`: the built-in task as JSONL files."""

from __future__ import annotations

import argparse
from pathlib import Path

from grpolab.cli.common import named_errors


def add_parser(subparsers) -> argparse.ArgumentParser:
    dt = subparsers.add_parser("data", help="write the built-in task as JSONL files: SFT pairs, GRPO prompts, "
                                            "held-out prompts, preference pairs of the accuracy and refusal reward "
                                            "models")
    dt.add_argument("config", nargs="?", default="grpo", help="a preset or YAML file (data.*, sft.* settings)")
    dt.add_argument("overrides", nargs="*")
    dt.add_argument("--out", required=True, help="output folder")
    dt.add_argument("--prompts", type=int, default=2000, help="GRPO training prompts")
    dt.add_argument("--pairs", type=int, default=2000, help="training preference pairs per reward model")
    dt.add_argument("--heldout-pairs", type=int, default=500, help="held-out preference pairs per reward model")
    dt.set_defaults(fn=run)
    return dt


def run(args) -> int:
    return named_errors(_run, args)


def _run(args) -> int:
    from grpolab.app.common import load_config
    from grpolab.data.export import export_builtin
    from grpolab.errors import ConfigError

    if "=" in args.config:  # no config given: the first positional is an override
        args.config, args.overrides = "grpo", [args.config, *args.overrides]
    cfg = load_config(args.config, args.overrides)
    if cfg.data.source != "builtin:arith":
        raise ConfigError(f"data.source={cfg.data.source!r}: grpolab data writes the built-in task (builtin:arith)")
    files = export_builtin(cfg, Path(args.out), prompts=args.prompts, pairs=args.pairs,
                           heldout_pairs=args.heldout_pairs)
    for name, path in files.items():
        print(f"{name:<24} {path}")
    return 0
