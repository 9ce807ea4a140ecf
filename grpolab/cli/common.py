"""What the command modules share: the --overwrite help, and bad input as one message."""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

OVERWRITE_HELP = "when the output folder holds a run, move that run aside (DIR.old-<time>; nothing is deleted)"


def on_rank0() -> bool:
    """Whether this process prints input errors: rank 0 of a torchrun launch, or the only process."""
    return os.environ.get("RANK", "0") == "0"


def named_errors(run: Callable[[Any], int], args) -> int:
    """run(args); bad input (data, model, rewards, checkpoints) ends it with one paragraph naming the
    culprit, not a traceback (GRPOLAB_DEBUG=1 shows it); config errors go to main()."""
    from grpolab.errors import ConfigError
    from grpolab.rewards.base import RewardError
    from grpolab.rundir.checkpoint import CheckpointError

    try:
        return run(args)
    except ConfigError:
        raise
    except (CheckpointError, RewardError, ValueError, FileNotFoundError, FileExistsError) as e:
        if os.environ.get("GRPOLAB_DEBUG"):
            raise
        if on_rank0():
            print(f"grpolab: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a read-only or forbidden path: the path and the reason in words
        if os.environ.get("GRPOLAB_DEBUG"):
            raise
        from grpolab.errors import os_reason

        where = f"{e.filename}: " if e.filename else ""
        if on_rank0():
            print(f"grpolab: error: {where}{os_reason(e)} (the last complete checkpoint, if any, is kept)",
                  file=sys.stderr)
        return 2
