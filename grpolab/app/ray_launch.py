"""`grpolab train CONFIG --ray [ADDRESS] [--nproc N]`: the run placed on a Ray cluster.

The driver (this process) joins the cluster at ADDRESS (`auto`, `HOST:6379`, `ray://HOST:10001`),
or starts a local one, reserves a placement group of N trainer bundles (a CPU share each, and a
GPU each when model.device is CUDA; packed onto as few nodes as fit) and starts one `TrainerRank`
actor per bundle. GPU placement of the rollout workers: rollout.worker_gpus = 1 gives each a GPU of
its own outside the trainer's bundles (separate mode); a fraction puts them in the trainer ranks'
bundles, round-robin, on the trainer's GPU (colocated mode: the trainer actor takes what they leave;
a vLLM engine sleeps while the trainer learns). Each rank runs the same command as `grpolab train` does under torchrun: rank 0's
actor picks the rendezvous address, every actor gets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
and joins the torch.distributed group (gloo on CPUs, NCCL on GPUs) of `train.parallel`; one rank
runs without a process group, as a plain `grpolab train` does. Rank 0 then starts the
rollout.workers rollout actors and every rank its rollout.reward_workers reward actors
(grpolab/rollout/ray_engine.py, grpolab/rewards/pool.py), on the same cluster.

The run directory must be on a file system every trainer node sees (rank 0 writes it; all ranks
write their checkpoint shards). SIGTERM / SIGINT to the driver reach every rank as the signal
would (finish the step, save, exit 128 + signal); a second one ends the actors at once.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from typing import Callable

from grpolab.parallel.ray_cluster import connect, require_ray


class TrainerRank:
    """A Ray actor running one trainer rank of `grpolab train`: `main`, the command line's entry point
    (grpolab.cli.main), with the rank's command line."""

    def __init__(self, main: Callable[[list[str]], int]):
        self.main = main

    def address(self) -> tuple[str, int]:
        """This node's address and a free port for the process group's rendezvous."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def run(self, argv: list[str], rank: int, world: int, master: tuple[str, int] | None, gpus: bool) -> int:
        """`grpolab ARGV` as rank `rank` of `world`; returns its exit code."""
        os.environ["GRPOLAB_RAY_TRAINER"] = "1"
        if world > 1:
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                              LOCAL_RANK="0" if gpus else str(rank),  # Ray shows each actor its own GPU
                              MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
        return self.main(argv)

    def stop(self, signum: int) -> bool:
        from grpolab.grpo.signals import request_stop

        return request_stop(signum)


def strip_ray(argv: list[str]) -> list[str]:
    """argv without `--ray [ADDRESS]` / `--ray=ADDRESS` and `--nproc N` (the actors' command line)."""
    from grpolab.parallel.launch import strip_nproc

    out, i = [], 0
    argv = strip_nproc(argv)
    while i < len(argv):
        a = argv[i]
        if a == "--ray":
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            i += 2 if nxt and not nxt.startswith("-") and "=" not in nxt else 1
            continue
        if not a.startswith("--ray="):
            out.append(a)
        i += 1
    return out


def run_on_ray(cfg, argv: list[str], address: str, nproc: int, main: Callable[[list[str]], int],
               ready_timeout_s: float = 300.0) -> int:
    """Runs `grpolab ARGV` (a train command, --ray and --nproc removed) as `nproc` trainer-rank
    actors of the cluster, each calling main(ARGV) (grpolab.cli.main); returns the first non-zero exit
    code of a rank, else 0."""
    ray = require_ray()
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    connect(cfg, nproc + cfg.rollout.workers + cfg.rollout.reward_workers, address)
    gpus = cfg.model.device.startswith("cuda")
    cpus = max(1, cfg.run.threads)
    guests = colocated_workers(cfg, nproc)
    trainer_gpus = (1 - guests * cfg.rollout.worker_gpus) if gpus else 0
    bundle = {"CPU": cpus + guests, **({"GPU": 1} if gpus else {})}  # a GPU each, shared with its guests
    pg = placement_group([bundle] * nproc, strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=ready_timeout_s)
    if not ready:
        raise ValueError(f"the Ray cluster has no room for {nproc} trainer rank(s) of {bundle} after "
                         f"{ready_timeout_s:.0f} s (ray status shows its resources); lower --nproc or run.threads")
    actor = ray.remote(TrainerRank)
    ranks = [actor.options(num_cpus=cpus, num_gpus=trainer_gpus, max_concurrency=2,
                           scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i))
             .remote(main) for i in range(nproc)]
    master = ray.get(ranks[0].address.remote()) if nproc > 1 else None
    runs = [a.run.remote(argv, i, nproc, master, gpus) for i, a in enumerate(ranks)]
    signals = []

    def forward(signum, frame):
        signals.append(signum)
        if len(signals) == 1:
            for a in ranks:
                a.stop.remote(signum)
        else:
            print(f"grpolab: second {signal.Signals(signum).name}: ending the trainer ranks now", file=sys.stderr)
            for a in ranks:
                ray.kill(a)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        codes = _wait(ray, runs)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        ray.shutdown()
    if len(signals) > 1:
        return 128 + signals[-1]
    return next((c for c in codes if c), 0)


def colocated_workers(cfg, nproc: int) -> int:
    """Rollout workers placed in each trainer rank's bundle, sharing its GPU (colocated mode:
    0 < rollout.worker_gpus < 1 with a CUDA model); 0 otherwise (separate mode, or CPUs)."""
    share = cfg.rollout.worker_gpus
    if not (cfg.model.device.startswith("cuda") and 0 < share < 1 and cfg.rollout.workers):
        return 0
    per = -(-cfg.rollout.workers // nproc)
    if per * share >= 1:
        raise ValueError(f"rollout.worker_gpus={share} × {per} rollout worker(s) per trainer GPU leaves the trainer "
                         "no share of it; lower rollout.worker_gpus or rollout.workers, or use whole GPUs (1)")
    return per


def _wait(ray, runs: list) -> list[int]:
    """Each rank's exit code (1 for a rank that raised or died: its error is printed)."""
    pending = list(runs)
    while pending:  # short waits: the signal handler runs between them
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
    codes = []
    for rank, ref in enumerate(runs):
        try:
            codes.append(int(ray.get(ref)))
        except Exception as e:  # noqa: BLE001 - a rank's failure, reported and turned into an exit code
            msg = " ".join(str(e).split())
            print(f"grpolab: trainer rank {rank} failed: {msg[-600:]}", file=sys.stderr)
            codes.append(1)
    return codes
