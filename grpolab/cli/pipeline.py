"""`grpolab pipeline CONFIG [overrides]`: SFT -> reward models -> GRPO -> evaluation -> report from one
YAML file (grpolab/app/pipeline.py)."""

from __future__ import annotations

import argparse

from grpolab.cli.common import named_errors


def add_parser(subparsers) -> argparse.ArgumentParser:
    pl = subparsers.add_parser("pipeline", help="the whole pipeline from one YAML: SFT -> reward models -> GRPO -> "
                                                "evaluation -> report (finished stages are skipped on a re-run)")
    pl.add_argument("config", help="a pipeline YAML file (see examples/seed_pipeline.yaml)")
    pl.add_argument("overrides", nargs="*", help="SECTION.key=value, e.g. grpo.train.steps=5 or "
                                                 "reward_models.accuracy.steps=50")
    pl.add_argument("--from", dest="redo", default="", metavar="STAGE",
                    help="redo this stage (sft, reward_models, grpo, eval) and the ones after it; their folders "
                         "are moved aside")
    pl.add_argument("--overwrite", action="store_true", help="when out_dir holds files grpolab pipeline did not "
                    "write (or another command's run), move them aside (DIR.old-<time>; nothing is deleted)")
    pl.add_argument("--no-report", action="store_true", help="skip the GRPO stage's report.html")
    pl.set_defaults(fn=run)
    return pl


def run(args) -> int:
    return named_errors(_run, args)


def _run(args) -> int:
    from grpolab.api.runs import pipeline
    from grpolab.app.pipeline import format_table

    result = pipeline(args.config, args.overrides, redo=args.redo, report=not args.no_report, overwrite=args.overwrite)
    print(format_table(result.payload))
    print(f"pipeline directory: {result.out_dir}")
    return 0
