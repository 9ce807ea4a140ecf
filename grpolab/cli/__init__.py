"""Command line: grpolab demo | train | sft | eval | report | compare | export | pipeline | data | config | rm |
sharpen | ablate.

One module per command, each with its `add_parser(subparsers)` (the arguments) and `run(args)` (the
call of the application layer, grpolab/app/, or of the library function the command is).
"""

from __future__ import annotations

import argparse
import sys

from grpolab.cli import ablate, compare, config, data, demo, export, pipeline, report, rm, sft, sharpen, train
from grpolab.cli import eval as eval_command
from grpolab.errors import ConfigError

COMMANDS = (demo, train, sft, eval_command, report, compare, export, pipeline, data, config, rm, sharpen, ablate)
"""The subcommands, in the order `grpolab --help` lists them."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grpolab", description="GRPO and the SFT-to-GRPO spectrum")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # key=value overrides after an option (`--samples 2 run.threads=1`) join the others
        if not hasattr(args, "overrides") or any(x.startswith("-") or "=" not in x for x in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    args.argv = argv
    args.main = main  # what a Ray trainer rank runs with the same command line (`grpolab train --ray`)
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"grpolab: config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("grpolab: interrupted", file=sys.stderr)
        return 130
    finally:  # the command's output folders are free for the next one
        from grpolab.rundir.lock import release_all

        release_all()
