"""Starting data-parallel ranks: torchrun's environment in, a `Parallel` out.

`torchrun --nproc-per-node N -m grpolab train CONFIG` (or `grpolab train CONFIG --nproc N`, which
starts that torchrun on this host) runs N copies of the command; torchrun gives each its RANK,
LOCAL_RANK and WORLD_SIZE and the rendezvous address. `init_parallel` joins the process group:
NCCL when the model lives on CUDA (each rank on GPU LOCAL_RANK), gloo on CPU.
"""

from __future__ import annotations

import hashlib
import os
import sys

import torch

from grpolab.parallel.parallel import Parallel


def launch_world_size() -> int:
    """Ranks the launcher started (torchrun's WORLD_SIZE; 1 without a launcher)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} in the environment is not a number") from None


def launched() -> bool:
    """Started by torchrun (or another launcher that sets WORLD_SIZE and RANK)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def init_parallel(device: str, strategy: str, compute_dtype: torch.dtype | None = None) -> Parallel:
    """Joins torchrun's process group (once per process) and returns this rank's Parallel, also for
    a world of one rank (then DDP or FSDP2 run their code paths on one device); a process started
    without a launcher gets Parallel() and no process group."""
    if not launched():
        return Parallel()
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")  # CPU scalars over gloo
    return Parallel(torch.distributed.get_rank(), torch.distributed.get_world_size(), strategy, compute_dtype)


def close_parallel() -> None:
    """Leaves the process group (at the end of a command)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def step_seed(seed: int, rank: int, step: int, stream: str) -> int:
    """The seed of one random stream ("sample", "shuffle") of one rank at one step: a hash of
    (seed, rank, step, stream), so a run is reproducible at a given world size and a resumed step
    draws what it drew the first time, whatever happened before it."""
    digest = hashlib.blake2b(f"{seed}/{rank}/{step}/{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    """The torchrun command line that `grpolab ... --nproc N` stands for: N ranks on this host
    (a standalone rendezvous), each running `python -m grpolab` with `argv` (without --nproc)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "grpolab", *argv]


def strip_nproc(argv: list[str]) -> list[str]:
    """argv without its `--nproc N` / `--nproc=N`."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def apply_threads(cfg):
    """Applies run.threads of a Config to this process's torch (0 = leave torch's default); returns cfg."""
    if cfg.run.threads > 0:
        torch.set_num_threads(cfg.run.threads)
    return cfg
