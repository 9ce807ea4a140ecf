"""Reward functions for the Ray tests, imported by name ('slow_rewards:...') in reward-worker actors."""

from __future__ import annotations

import json
import os
import time


def sleepy(log: str, seconds: float = 1.0):
    """A reward that sleeps `seconds` per call and appends {pid, start, end, rows} to the file `log`;
    scores each completion by its length."""
    def score(prompts, completions, metadata):
        start = time.time()
        time.sleep(seconds)
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"pid": os.getpid(), "start": start, "end": time.time(), "rows": len(completions)}) + "\n")
        return [float(len(c)) for c in completions]
    return score


def only_in(pid: int):
    """A reward that can be built in process `pid` only (as a module missing on the other nodes would be)."""
    if os.getpid() != pid:
        raise RuntimeError(f"cannot be built outside process {pid}")
    return lambda prompts, completions, metadata: [0.0] * len(completions)
