"""`grpolab train CONFIG [overrides]`: GRPO (or any preset of the spectrum), on one process, under
torchrun (--nproc N) or on a Ray cluster (--ray)."""

from __future__ import annotations

import argparse
import os
import sys

from grpolab.cli.common import OVERWRITE_HELP, named_errors


def add_parser(subparsers) -> argparse.ArgumentParser:
    t = subparsers.add_parser("train", help="GRPO (or any preset of the spectrum) from a YAML config or a preset name")
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
    t.set_defaults(fn=run)
    return t


def run(args) -> int:
    if args.ray is not None and not os.environ.get("GRPOLAB_RAY_TRAINER"):  # the driver: ranks become actors
        return named_errors(_on_ray, args)
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:  # start torchrun, which runs this command per rank
        from grpolab.parallel.launch import run_torchrun, strip_nproc, torchrun_command

        code = named_errors(_validate_for_ranks, args)  # input errors once, here, before any rank starts
        if code:
            return code
        argv = strip_nproc(args.argv)
        print("grpolab: " + " ".join(torchrun_command(args.nproc, argv)[1:]), file=sys.stderr, flush=True)
        return run_torchrun(args.nproc, argv)  # the launcher in this process: a rank's input error said once, rc 2
    from grpolab.parallel.launch import close_parallel

    try:
        return named_errors(_here, args)
    finally:
        close_parallel()


def _validate_for_ranks(args) -> int:
    """Loads and validates the config as each of the --nproc ranks will (ConfigError naming the field)."""
    from grpolab.api.configs import make_config

    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(args.nproc)
    try:
        make_config(args.config, args.overrides)
    finally:
        if saved is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = saved
    return 0


def _here(args) -> int:
    from grpolab.api.runs import train

    return train(args.config, args.overrides, resume=args.resume, overwrite=args.overwrite).exit_code


def _on_ray(args) -> int:
    from grpolab.app.common import load_config
    from grpolab.app.ray_launch import run_on_ray, strip_ray
    from grpolab.errors import ConfigError

    argv = strip_ray(args.argv)
    if args.ray and "=" in args.ray:  # `--ray key=value`: an override, not an address (strip_ray kept it)
        args.overrides, args.ray = [*args.overrides, args.ray], "local"
    cfg = load_config(args.config, args.overrides).validate()  # config errors are named here, before any actor starts
    if args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc}: at least 1 trainer rank")
    return run_on_ray(cfg, argv, args.ray or "local", args.nproc, args.main)
