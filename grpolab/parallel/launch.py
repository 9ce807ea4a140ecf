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


RANK_ERRORS = "GRPOLAB_RANK_ERRORS"
"""The environment variable naming the folder where the ranks of a `--nproc` launch leave their input
errors (`rank_error`), for the launching process to print once."""


def rank_error(message: str) -> bool:
    """Under a `grpolab ... --nproc N` launch, leaves this rank's input error (one paragraph) for the
    launching process, which prints it once and exits 2 (`run_torchrun`); False elsewhere (plain
    torchrun or one process: the caller prints it)."""
    folder = os.environ.get(RANK_ERRORS)
    if not folder or not launched():
        return False
    path = os.path.join(folder, f"rank-{int(os.environ['RANK']):05d}.txt")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(message)
    os.replace(path + ".tmp", path)
    return True


def run_torchrun(nproc: int, argv: list[str], say=None) -> int:
    """Runs torchrun's launcher in this process (`torchrun_command`: N ranks of `python -m grpolab argv`)
    and returns the command's exit code. An input error of the ranks (`rank_error`) is printed once
    and gives 2; a rank that fails otherwise is one line naming it, its exit code or signal and what
    to do, and gives its exit code (128 + the signal's number when killed); a signal that stops the
    launcher gives 128 + its number. Never the launcher's own traceback."""
    import logging
    import tempfile

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    quiet = logging.getLogger("torch.distributed.elastic.multiprocessing.api")  # its lines on a rank's exit
    level = quiet.level
    saved = {k: os.environ.get(k) for k in (RANK_ERRORS, "OMP_NUM_THREADS")}
    with tempfile.TemporaryDirectory(prefix="grpolab-ranks-") as folder:
        os.environ[RANK_ERRORS] = folder
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several ranks (run.threads sets it)
        quiet.setLevel(logging.CRITICAL)
        try:
            run(parse_args(torchrun_command(nproc, argv)[3:]))
            return 0
        except ChildFailedError as e:
            return _failed_ranks(e, folder, nproc, say)
        except SignalException as e:
            say(f"grpolab: stopped by {e.sigval.name}; the ranks were stopped with it")
            return 128 + int(e.sigval)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            quiet.setLevel(level)


def _failed_ranks(error, folder: str, nproc: int, say) -> int:
    """The exit code of a failed launch (see `run_torchrun`), its message said once."""
    from pathlib import Path

    messages = [p.read_text(encoding="utf-8") for p in sorted(Path(folder).glob("rank-*.txt"))]
    if messages:
        for message in dict.fromkeys(messages):  # every rank finds the same error: said once
            say(message)
        return 2
    rank, failure = error.get_first_failure()
    how = f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with code {failure.exitcode}"
    say(f"grpolab: error: rank {rank} of {nproc} (pid {failure.pid}) {how}, and the other ranks were stopped; its "
        "output above says why. The run folder keeps its last complete checkpoint: add --resume to continue it")
    return 128 - failure.exitcode if failure.exitcode < 0 else failure.exitcode


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
