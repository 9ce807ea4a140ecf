"""`grpolab eval MODEL [CONFIG] [overrides]`: held-out evaluation of a model (an HF folder, or a run
directory's final/) by a config's rewards: greedy, and with --samples K sampled pass@1 / pass@K, per
metadata value with eval.group_by=FIELD; JSON on stdout (and --out), every prompt's completions and
scores in --completions (default: completions.jsonl beside --out)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from grpolab.cli.common import named_errors


def add_parser(subparsers) -> argparse.ArgumentParser:
    e = subparsers.add_parser("eval", help="held-out evaluation of a model by a config's rewards (greedy; sampled "
                                           "with --samples)")
    e.add_argument("model", help="an HF folder, or a run directory (its final/)")
    e.add_argument("config", nargs="?", default="grpo", help="a YAML file or preset: data.eval_source (or the "
                                                               "built-in task's held-out split), rewards, rollout")
    e.add_argument("overrides", nargs="*")
    e.add_argument("--samples", type=int, default=0, metavar="K", help="also K sampled completions per prompt: "
                                                                        "mean reward, pass@1, pass@K")
    e.add_argument("--best-of", type=int, default=0, metavar="N",
                   help="also best-of-N by the model's own sequence likelihood vs greedy (the inference-time "
                        "effect of sharpening)")
    e.add_argument("--out", default="", help="also write the result (with examples) to this JSON file")
    e.add_argument("--completions", default="", metavar="PATH", help="write every held-out prompt's completions, "
                   "scores and metadata to this JSONL file (default with --out: completions.jsonl beside it)")
    e.set_defaults(fn=run)
    return e


def run(args) -> int:
    return named_errors(_run, args)


def _run(args) -> int:
    from grpolab.api.runs import evaluate
    from grpolab.app.common import say
    from grpolab.evaluation.evaluate import format_eval, write_completions

    res = evaluate(args.model, args.config, args.overrides, samples=args.samples, best_of=args.best_of).metrics
    records = res.pop("completions", [])
    completions = args.completions or (str(Path(args.out).with_name("completions.jsonl")) if args.out else "")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    if completions:
        write_completions(completions, records)
        say(f"completions and scores of {len(records)} held-out prompts: {completions}")
    print(json.dumps({k: v for k, v in res.items() if k != "examples"}, indent=2))
    say(format_eval(res))
    return 0
