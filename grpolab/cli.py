"""Command line: grpolab demo | train | sft | eval | rm | pipeline | data | sharpen | ablate | report | compare |
config | export."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _threads(cfg):
    """Applies run.threads (0 = leave torch's default); returns cfg."""
    from grpolab.train.setup import apply_threads

    return apply_threads(cfg)


def _demo(args) -> int:
    from grpolab.demo import demo_config, run_demo

    cfg = _threads(demo_config(quick=args.quick, seed=args.seed, overrides=args.overrides, rewards=args.rewards,
                               accuracy_rm=args.accuracy_rm))
    if args.out:
        cfg = cfg.replace(**{"run.out_dir": args.out})
    run_demo(cfg, report=not args.no_report, rewards=args.rewards, overwrite=args.overwrite,
             rm_options={"accuracy": args.accuracy_rm} if args.rewards == "rm" else None)
    return 0


def _load_cfg(args):
    from grpolab import config as C

    if args.config in C.PRESETS:
        return C.from_preset(args.config, args.overrides)
    return C.load(args.config, args.overrides)


def _train(args) -> int:
    import os

    if args.ray is not None and not os.environ.get("GRPOLAB_RAY_TRAINER"):  # the driver: ranks become actors
        return _named_errors(_train_on_ray, args)
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:  # start torchrun, which runs this command per rank
        from grpolab.parallel.launch import strip_nproc, torchrun_command

        cmd = torchrun_command(args.nproc, strip_nproc(args.argv))
        print("grpolab: " + " ".join(cmd[1:]), file=sys.stderr, flush=True)
        os.execv(cmd[0], cmd)  # signals reach torchrun, which forwards them to the ranks
    from grpolab.parallel.launch import close_parallel

    try:
        return _named_errors(_train_run, args)
    finally:
        close_parallel()


def _train_on_ray(args) -> int:
    from grpolab.parallel.ray_launch import run_on_ray, strip_ray

    argv = strip_ray(args.argv)
    if args.ray and "=" in args.ray:  # `--ray key=value`: an override, not an address (strip_ray kept it)
        args.overrides, args.ray = [*args.overrides, args.ray], "local"
    cfg = _load_cfg(args).validate()  # config errors are named here, before any actor starts
    if args.nproc < 1:
        from grpolab.config import ConfigError

        raise ConfigError(f"--nproc {args.nproc}: at least 1 trainer rank")
    return run_on_ray(cfg, argv, args.ray or "local", args.nproc)


def _named_errors(run, args) -> int:
    """run(args); bad input (data, model, rewards, checkpoints) ends it with one paragraph naming the
    culprit, not a traceback (GRPOLAB_DEBUG=1 shows it); config errors go to main()."""
    import os

    from grpolab.config import ConfigError
    from grpolab.rewards.base import RewardError
    from grpolab.train.checkpoint import CheckpointError

    try:
        return run(args)
    except ConfigError:
        raise
    except (CheckpointError, RewardError, ValueError, FileNotFoundError, FileExistsError) as e:
        if os.environ.get("GRPOLAB_DEBUG"):
            raise
        print(f"grpolab: error: {e}", file=sys.stderr)
        return 2


def _train_run(args) -> int:
    from grpolab.config import ConfigError

    cfg = _threads(_load_cfg(args))
    if args.resume and args.overwrite:
        raise ConfigError("--resume continues the run in run.out_dir and --overwrite moves it aside: choose one")
    if args.resume:
        cfg = cfg.replace(**{"run.resume": cfg.run.resume or "auto"})
    if cfg.loss.policy_loss == "sft":
        return sft_from_cfg(cfg, overwrite=args.overwrite)
    return train_from_cfg(cfg, overwrite=args.overwrite)


def train_from_cfg(cfg, overwrite: bool = False) -> int:
    """`grpolab train` of a loaded config: run directory, resume (run.resume), the loop, final/."""
    from grpolab.config import ConfigError
    from grpolab.parallel.launch import init_parallel
    from grpolab.report.progress import Progress
    from grpolab.train.checkpoint import resolve_resume, step_of
    from grpolab.train.run import make_run_dir, train_in_run_dir, write_config
    from grpolab.train.setup import build_setup, resolve_compute_dtype

    if cfg.run.resume == "auto" and not cfg.run.out_dir:
        raise ConfigError("--resume (run.resume=auto) needs the run folder to continue: add run.out_dir=DIR")
    par = init_parallel(cfg.model.device, cfg.train.parallel, resolve_compute_dtype(cfg.model.dtype, cfg.model.device))
    say = _stderr if par.is_main else None
    if cfg.off_policy_steps and say is not None:
        from grpolab.config_reference import off_policy_note

        say(f"grpolab: note: {off_policy_note(cfg)}")
    resume_from = None if overwrite else resolve_resume(cfg.run.resume, Path(cfg.run.out_dir or "."), say=say,
                                                      checkpoint_every=cfg.run.checkpoint_every)
    if resume_from is not None and not cfg.run.out_dir:  # an explicit checkpoint: continue its run
        cfg = cfg.replace(**{"run.out_dir": str(resume_from.parent.parent)})
    run_dir = Path(_on_rank0(par, lambda: str(make_run_dir(cfg, command="train", resume=bool(cfg.run.resume),
                                                            overwrite=overwrite))))
    if par.is_main:
        write_config(cfg, run_dir)
    start = min(step_of(resume_from), cfg.train.steps) if resume_from is not None else 0
    progress = Progress(cfg.train.steps, enabled=cfg.run.progress and par.is_main, start_step=start)
    setup = build_setup(cfg, progress=progress, parallel=par)
    code = train_in_run_dir(setup, run_dir, resume_from)
    if par.is_main:
        print(f"run directory: {run_dir}")
    return code


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _on_rank0(par, fn):
    """fn() on rank 0, its result (or its ConfigError, raised again) on every rank."""
    from grpolab.config import ConfigError

    result = None
    if par.is_main:
        try:
            result = ("ok", fn())
        except ConfigError as e:
            result = ("error", str(e))
    kind, value = par.broadcast(result)
    if kind == "error":
        raise ConfigError(value)
    return value


def _print_sft_loss(i: int, loss: float) -> None:
    if i == 0 or (i + 1) % 50 == 0:
        print(f"[sft] step {i + 1} loss {loss:.4f}")


def sft_from_cfg(cfg, overwrite: bool = False) -> int:
    from grpolab.data.build import arith_task
    from grpolab.train.run import make_run_dir, write_config
    from grpolab.train.rundir import mark_finished
    from grpolab.train.setup import load_policy
    from grpolab.train.sft import sft_builtin, train_sft

    run_dir = make_run_dir(cfg, "sft", command="sft", overwrite=overwrite)
    write_config(cfg, run_dir)
    model, tok = load_policy(cfg)
    if cfg.data.source != "builtin:arith":
        from grpolab.data.build import source_options
        from grpolab.data.sft_pairs import load_sft_pairs

        d = cfg.data
        pairs = load_sft_pairs(d.source, response_field=d.response_field, prompt_field=d.prompt_field,
                               messages_field=d.messages_field, **source_options(cfg, tok))
        losses = train_sft(model, tok, pairs, steps=cfg.sft.steps, batch_size=cfg.sft.batch_size,
                           microbatch_size=cfg.sft.microbatch_size, lr=cfg.sft.lr, seed=cfg.train.seed,
                           on_step=_print_sft_loss)
    else:  # the built-in task: refusal kinds and the early stop on a training-side probe as in the demo
        losses = sft_builtin(model, tok, arith_task(cfg), cfg)
    model.save_pretrained(run_dir / "final")
    tok.save_pretrained(run_dir / "final")
    mark_finished(run_dir)
    print(f"final loss {losses[-1]:.4f}; run directory: {run_dir}")
    return 0


def _sft(args) -> int:
    return _named_errors(_sft_run, args)


def _sft_run(args) -> int:
    from grpolab import config as C

    base = args.config or "sft"
    cfg = _threads(C.from_preset(base, args.overrides) if base in C.PRESETS else C.load(base, args.overrides))
    return sft_from_cfg(cfg.replace(**{"loss.policy_loss": "sft"}), overwrite=args.overwrite)


def _eval(args) -> int:
    return _named_errors(_eval_run, args)


def _eval_run(args) -> int:
    """Held-out evaluation of a model (an HF folder, or a run directory's final/) by a config's
    rewards: greedy, and with --samples K sampled pass@1 / pass@K; JSON on stdout (and --out)."""
    import json

    from grpolab import config as C
    from grpolab.train.evaluate import evaluate_model, format_eval

    cfg = _threads(C.from_preset(args.config, args.overrides) if args.config in C.PRESETS
                   else C.load(args.config, args.overrides))
    res = evaluate_model(args.model, cfg, samples=args.samples, best_of=args.best_of)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps({k: v for k, v in res.items() if k != "examples"}, indent=2))
    _stderr(format_eval(res))
    return 0


def _report(args) -> int:
    return _named_errors(_report_run, args)


def _report_run(args) -> int:
    from grpolab.report.html import write_report

    print(write_report(args.run_dir))
    return 0


def _compare(args) -> int:
    from grpolab.report.compare import write_compare

    print(write_compare(args.run_dirs, args.out))
    return 0


def _export(args) -> int:
    return _named_errors(_export_run, args)


def _export_run(args) -> int:
    from grpolab.train.export import export_run

    print(f"exported to {export_run(args.run_dir, args.out, args.step)}")
    return 0


def _pipeline(args) -> int:
    return _named_errors(_pipeline_run, args)


def _pipeline_run(args) -> int:
    from grpolab.pipeline import format_table, load_pipeline, run_pipeline

    p = load_pipeline(args.config, args.overrides)
    payload = run_pipeline(p, redo=args.redo, report=not args.no_report)
    print(format_table(payload))
    print(f"pipeline directory: {p.out_dir}")
    return 0


def _data(args) -> int:
    return _named_errors(_data_run, args)


def _data_run(args) -> int:
    from grpolab.data.export import export_builtin

    if "=" in args.config:  # no config given: the first positional is an override
        args.config, args.overrides = "grpo", [args.config, *args.overrides]
    cfg = _load_cfg(args)
    if cfg.data.source != "builtin:arith":
        from grpolab.config import ConfigError

        raise ConfigError(f"data.source={cfg.data.source!r}: grpolab data writes the built-in task (builtin:arith)")
    files = export_builtin(cfg, Path(args.out), prompts=args.prompts, pairs=args.pairs,
                           heldout_pairs=args.heldout_pairs)
    for name, path in files.items():
        print(f"{name:<24} {path}")
    return 0


def _config(args) -> int:
    from grpolab import config as C
    from grpolab.config_reference import config_reference

    if args.config not in C.PRESETS and not Path(args.config).is_file():
        raise C.ConfigError(f"{args.config!r} is neither a preset ({', '.join(C.PRESETS)}) nor a config file")
    cfg = _load_cfg(args)
    title = " ".join(["grpolab config", args.config, *args.overrides])
    print(config_reference(cfg, title), end="")
    return 0


OVERWRITE_HELP = "when the output folder holds a run, move that run aside (DIR.old-<time>; nothing is deleted)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grpolab", description="GRPO and the SFT-to-GRPO spectrum")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="build a tiny model, SFT it, GRPO it, evaluate (offline, CPU)")
    d.add_argument("--quick", action="store_true", help="a shorter run (about 3 minutes)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--out", default="", help="run directory (default: a new folder under runs/)")
    d.add_argument("--no-report", action="store_true", help="skip report.html")
    d.add_argument("--rewards", choices=("rm", "rules"), default="rules",
                   help="GRPO rewards: two learned reward models (seed 000) or the exact rule checks")
    d.add_argument("--accuracy-rm", choices=("process", "outcome", "ensemble"), default="process",
                   help="with --rewards rm: the accuracy RM scores each answer token by its backbone's language "
                        "model (process: the weakest token counts), the whole answer at EOS (outcome, refreshed on "
                        "the policy's samples), or is 3 outcome RMs (ensemble: the lowest counts)")
    d.add_argument("overrides", nargs="*", help="config overrides, e.g. train.steps=50")
    d.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    d.set_defaults(fn=_demo)

    t = sub.add_parser("train", help="GRPO (or any preset of the spectrum) from a YAML config or a preset name")
    t.add_argument("config", help="a YAML file or a preset name (grpo, dapo, ...)")
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. loss.clip_eps_high=0.28")
    t.add_argument("--resume", action="store_true",
                   help="continue run.out_dir from its latest complete checkpoint (a fresh start if it has none); "
                        "put it after the overrides. run.resume=PATH picks a checkpoint")
    t.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    t.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="data-parallel ranks on this host: starts `torchrun --standalone --nproc-per-node N "
                        "-m grpolab train ...` (train.parallel picks ddp or fsdp2; use torchrun itself for "
                        "several nodes)")
    t.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run on a Ray cluster (ADDRESS: auto, HOST:6379, ray://HOST:10001; none = a local one): "
                        "--nproc trainer ranks as actors in a placement group, rollout.workers rollout actors, "
                        "rollout.reward_workers reward actors")
    t.set_defaults(fn=_train)

    s = sub.add_parser("sft", help="supervised fine-tuning (token cross-entropy)")
    s.add_argument("config", nargs="?", default="", help="a YAML file or preset (default: sft)")
    s.add_argument("overrides", nargs="*")
    s.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    s.set_defaults(fn=_sft)

    e = sub.add_parser("eval", help="held-out evaluation of a model by a config's rewards (greedy; sampled with "
                                    "--samples)")
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
    e.set_defaults(fn=_eval)

    r = sub.add_parser("report", help="write RUN_DIR/report.html")
    r.add_argument("run_dir")
    r.set_defaults(fn=_report)

    c = sub.add_parser("compare", help="overlay the curves of several runs")
    c.add_argument("run_dirs", nargs="+")
    c.add_argument("--out", default="compare.html")
    c.set_defaults(fn=_compare)

    x = sub.add_parser("export", help="a run's policy as a standalone HF folder (LoRA merged, tokenizer, "
                                      "generation config)")
    x.add_argument("run_dir")
    x.add_argument("--out", required=True, help="a new folder")
    x.add_argument("--step", type=int, default=None, help="a step checkpoint (default: the final policy)")
    x.set_defaults(fn=_export)

    pl = sub.add_parser("pipeline", help="the seed's pipeline from one YAML: SFT -> reward models -> GRPO -> "
                                         "evaluation -> report (finished stages are skipped on a re-run)")
    pl.add_argument("config", help="a pipeline YAML file (see examples/seed_pipeline.yaml)")
    pl.add_argument("overrides", nargs="*", help="SECTION.key=value, e.g. grpo.train.steps=5 or "
                                                 "reward_models.accuracy.steps=50")
    pl.add_argument("--from", dest="redo", default="", metavar="STAGE",
                    help="redo this stage (sft, reward_models, grpo, eval) and the ones after it; their folders "
                         "are moved aside")
    pl.add_argument("--no-report", action="store_true", help="skip the GRPO stage's report.html")
    pl.set_defaults(fn=_pipeline)

    dt = sub.add_parser("data", help="write the built-in task as JSONL files: SFT pairs, GRPO prompts, held-out "
                                     "prompts, preference pairs of the accuracy and refusal reward models")
    dt.add_argument("config", nargs="?", default="grpo", help="a preset or YAML file (data.*, sft.* settings)")
    dt.add_argument("overrides", nargs="*")
    dt.add_argument("--out", required=True, help="output folder")
    dt.add_argument("--prompts", type=int, default=2000, help="GRPO training prompts")
    dt.add_argument("--pairs", type=int, default=2000, help="training preference pairs per reward model")
    dt.add_argument("--heldout-pairs", type=int, default=500, help="held-out preference pairs per reward model")
    dt.set_defaults(fn=_data)

    k = sub.add_parser("config", help="print every config field of a preset or YAML file: value, type, doc, choices")
    k.add_argument("config", help="a preset name (grpo, dapo, ...) or a YAML file")
    k.add_argument("overrides", nargs="*", help="key=value overrides, e.g. loss.loss_agg=token-mean")
    k.set_defaults(fn=_config)

    from grpolab import cli_ablate, cli_rm, cli_sharpen

    cli_rm.add_parser(sub)
    cli_sharpen.add_parser(sub)
    cli_ablate.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    from grpolab.config import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # key=value overrides after an option (`--samples 2 run.threads=1`) join the others
        if not hasattr(args, "overrides") or any(x.startswith("-") or "=" not in x for x in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    args.argv = argv
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"grpolab: config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("grpolab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

