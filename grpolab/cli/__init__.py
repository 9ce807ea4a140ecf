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
        command_parser = command.add_parser(sub)
        command_parser.set_defaults(command_parser=command_parser)
    return p


def _overrides_anywhere(parser, command_parser, args) -> None:
    """A command's positionals regrouped: every `key=value` (not an existing file's name) is an override
    wherever it stands (`grpolab eval MODEL k=v`, `grpolab sft k=v`), and what is left is the CONFIG
    (the command's default when none is left)."""
    if not hasattr(args, "config") or not hasattr(args, "overrides"):
        return
    import os

    words = [w for w in [args.config, *args.overrides] if w]
    is_override = [("=" in w and not os.path.exists(w)) for w in words]
    configs = [w for w, o in zip(words, is_override) if not o]
    if len(configs) > 1:
        parser.error(f"{args.command}: one CONFIG (a preset or a YAML file), got {' and '.join(map(repr, configs))}; "
                     "overrides are written key=value")
    default = command_parser.get_default("config")
    if not configs and default is None:
        parser.error(f"{args.command}: a CONFIG (a preset or a YAML file) is needed besides the key=value overrides")
    args.config = configs[0] if configs else default
    args.overrides = [w for w, o in zip(words, is_override) if o]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # key=value overrides after an option (`--samples 2 run.threads=1`) join the others
        if not hasattr(args, "overrides") or any(x.startswith("-") or "=" not in x for x in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    _overrides_anywhere(parser, args.command_parser, args)
    args.argv = argv
    args.main = main  # what a Ray trainer rank runs with the same command line (`grpolab train --ray`)
    try:
        return args.fn(args)
    except ConfigError as e:
        from grpolab.cli.common import say_input_error

        say_input_error(f"grpolab: config error: {e}")  # under torchrun every rank finds it: said once
        return 2
    except KeyboardInterrupt:
        print("grpolab: interrupted", file=sys.stderr)
        return 130
    finally:  # the command's output folders are free for the next one
        from grpolab.rundir.lock import release_all

        release_all()
