"""`grpolab demo`: build a tiny model, SFT it, GRPO it, evaluate (offline, CPU)."""

from __future__ import annotations

import argparse

from grpolab.cli.common import OVERWRITE_HELP


def add_parser(subparsers) -> argparse.ArgumentParser:
    d = subparsers.add_parser("demo", help="build a tiny model, SFT it, GRPO it, evaluate (offline, CPU)")
    d.add_argument("--quick", action="store_true", help="a shorter run (about 3 minutes)")
    d.add_argument("--agent", action="store_true",
                   help="the agent demo: a tiny chat model SFT'd on tool-use transcripts, then GRPO on multi-turn "
                        "episodes of a calculator-tool task and a guess-the-number environment")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--out", default="", help="run directory (default: a new folder under runs/)")
    d.add_argument("--no-report", action="store_true", help="skip report.html")
    d.add_argument("--rewards", choices=("rm", "rules"), default="rules",
                   help="GRPO rewards: two learned reward models (accuracy and refusal) or the exact rule checks")
    d.add_argument("--accuracy-rm", choices=("process", "outcome", "ensemble"), default="process",
                   help="with --rewards rm: the accuracy RM scores each answer token by its backbone's language "
                        "model (process: the weakest token counts), the whole answer at EOS (outcome, refreshed on "
                        "the policy's samples), or is 3 outcome RMs (ensemble: the lowest counts)")
    d.add_argument("overrides", nargs="*", help="config overrides, e.g. train.steps=50")
    d.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    d.add_argument("--resume", action="store_true",
                   help="continue a stopped demo in --out from its last checkpoint (same flags as before)")
    d.set_defaults(fn=run)
    return d


def run(args) -> int:
    from grpolab.app.demo import demo_config, run_demo
    from grpolab.config import ConfigError
    from grpolab.parallel.launch import apply_threads

    if args.resume and args.overwrite:
        raise ConfigError("--resume continues the demo in --out and --overwrite moves it aside: choose one")
    if args.agent:
        from grpolab.app.demo_agent import run_agent_demo

        if args.rewards != "rules":
            raise ConfigError("--rewards rm is the single-answer demo's; the agent demo's rewards are its environments'")
        run_agent_demo(args.seed, args.quick, args.out, args.overrides, report=not args.no_report, resume=args.resume,
                       overwrite=args.overwrite)
        return 0

    cfg = apply_threads(demo_config(quick=args.quick, seed=args.seed, overrides=args.overrides, rewards=args.rewards,
                                    accuracy_rm=args.accuracy_rm))
    if args.out:
        cfg = cfg.replace(**{"run.out_dir": args.out})
    run_demo(cfg, report=not args.no_report, rewards=args.rewards, overwrite=args.overwrite,
             rm_options={"accuracy": args.accuracy_rm} if args.rewards == "rm" else None, resume=args.resume)
    return 0
