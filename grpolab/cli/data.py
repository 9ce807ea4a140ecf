"""`grpolab data [CONFIG] --out DIR`: the built-in task as JSONL files."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpolab.cli.common import named_errors


def add_parser(subparsers) -> argparse.ArgumentParser:
    dt = subparsers.add_parser("data", help="write the built-in task as JSONL files: SFT pairs, GRPO prompts, "
                                            "held-out prompts, preference pairs of the accuracy and refusal reward "
                                            "models")
    dt.add_argument("config", nargs="?", default="grpo", help="a preset or YAML file (data.*, sft.* settings)")
    dt.add_argument("overrides", nargs="*")
    dt.add_argument("--out", required=True, help="output folder (files of yours there are never written over)")
    dt.add_argument("--prompts", type=int, default=2000, help="GRPO training prompts")
    dt.add_argument("--pairs", type=int, default=2000, help="training preference pairs per reward model")
    dt.add_argument("--heldout-pairs", type=int, default=500, help="held-out preference pairs per reward model")
    dt.add_argument("--overwrite", action="store_true", help="when --out holds files of these names that grpolab "
                    "data did not write, move the folder aside (DIR.old-<time>; nothing is deleted)")
    dt.set_defaults(fn=run)
    return dt


def run(args) -> int:
    return named_errors(_run, args)


def _run(args) -> int:
    from grpolab.app.common import load_config
    from grpolab.data.export import FILE_NAMES, export_builtin
    from grpolab.errors import ConfigError
    from grpolab.rundir.rundir import claim_files, record_outputs

    cfg = load_config(args.config, args.overrides)
    if cfg.data.source != "builtin:arith":
        raise ConfigError(f"data.source={cfg.data.source!r}: grpolab data writes the built-in task (builtin:arith)")
    out = claim_files(Path(args.out), "data", list(FILE_NAMES), overwrite=args.overwrite, field="--out",
                      say=lambda m: print(m, file=sys.stderr))
    files = export_builtin(cfg, out, prompts=args.prompts, pairs=args.pairs, heldout_pairs=args.heldout_pairs)
    record_outputs(out, list(files.values()))
    for name, path in files.items():
        print(f"{name:<24} {path}")
    return 0
