"""`grpolab config PRESET|FILE [overrides]`: every config field with its value, type, doc and choices; for a
pipeline file, each stage's (grpolab.app.pipeline_reference)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers) -> argparse.ArgumentParser:
    k = subparsers.add_parser("config", help="print every config field of a preset or YAML file: value, type, doc, "
                                             "choices")
    k.add_argument("config", help="a preset name (grpo, dapo, ...), a YAML config file or a pipeline file")
    k.add_argument("overrides", nargs="*", help="key=value overrides, e.g. loss.loss_agg=token-mean (a pipeline "
                   "file: SECTION.key=value, e.g. grpo.train.steps=5)")
    k.set_defaults(fn=run)
    return k


def run(args) -> int:
    from grpolab import config as C
    from grpolab.app.common import load_config
    from grpolab.app.config_reference import config_reference

    if args.config not in C.PRESETS and not Path(args.config).is_file():
        raise C.ConfigError(f"{args.config!r} is neither a preset ({', '.join(C.PRESETS)}) nor a config file")
    if args.config not in C.PRESETS:
        from grpolab.app.pipeline_reference import is_pipeline_file, pipeline_reference

        if is_pipeline_file(args.config):
            print(pipeline_reference(args.config, args.overrides), end="")
            return 0
    cfg = load_config(args.config, args.overrides)
    title = " ".join(["grpolab config", args.config, *args.overrides])
    print(config_reference(cfg, title), end="")
    return 0
