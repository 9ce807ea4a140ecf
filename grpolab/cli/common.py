"""What the command modules share: the --overwrite help, and bad input as one message."""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

OVERWRITE_HELP = "when the output folder holds a run, move that run aside (DIR.old-<time>; nothing is deleted)"


def on_rank0() -> bool:
    """Whether this process prints input errors: rank 0 of a torchrun launch, or the only process."""
    return os.environ.get("RANK", "0") == "0"


def say_input_error(message: str) -> None:
    """Prints an input error (one paragraph) once: a rank of `grpolab ... --nproc N` leaves it for the
    launching process (grpolab.parallel.launch.rank_error); under plain torchrun rank 0 prints it."""
    from grpolab.parallel.launch import rank_error

    if not rank_error(message) and on_rank0():
        print(message, file=sys.stderr)


def named_errors(run: Callable[[Any], int], args) -> int:
    """run(args); bad input (data, model, rewards, checkpoints) ends it with one paragraph naming the
    culprit, not a traceback (GRPOLAB_DEBUG=1 shows it), exit code 2; a Ray worker that died is one
    paragraph too (exit code 1); config errors go to main()."""
    from grpolab.errors import ConfigError, WorkerLostError
    from grpolab.rewards.base import RewardError
    from grpolab.rundir.checkpoint import CheckpointError

    try:
        return run(args)
    except ConfigError:
        raise
    except (CheckpointError, RewardError, ValueError, FileNotFoundError, FileExistsError) as e:
        if os.environ.get("GRPOLAB_DEBUG"):
            raise
        say_input_error(f"grpolab: error: {e}")
        return 2
    except WorkerLostError as e:  # a Ray worker died: not the user's input, but one message all the same
        if os.environ.get("GRPOLAB_DEBUG"):
            raise
        say_input_error(f"grpolab: error: {e}")
        return 1
    except OSError as e:  # a full disk, a read-only or forbidden path: the path and the reason in words
        if os.environ.get("GRPOLAB_DEBUG"):
            raise
        from grpolab.errors import os_reason

        where = f"{e.filename}: " if e.filename else ""
        say_input_error(f"grpolab: error: {where}{os_reason(e)} (the last complete checkpoint, if any, is kept)")
        return 2
