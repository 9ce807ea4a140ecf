"""The checkpoint hook of the GRPO loop: when to save (grpolab.rundir.checkpoint writes and loads).

It saves every run.checkpoint_every steps, after the last step and when a stop was requested, and
keeps the step boundary so that a step that fails before its first update can still be saved.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from grpolab.rundir.checkpoint import CHECKPOINTS, is_complete, rng_state, save_checkpoint, set_rng_state


class CheckpointHook:
    """A Setup hook (called after each step's metrics are written): saves every
    run.checkpoint_every steps, after the last step, and when a stop was requested.

    It also remembers the small part of the state that Phase A changes (RNGs, data cursor), so
    that a crash before the step's first optimizer step (a reward function raising, an
    out-of-memory in generation) can still be saved exactly as the step boundary (`save_on_error`).
    """

    def __init__(self, setup, run_dir: Path, loaded_from: Path | None = None):
        self.setup = setup
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / CHECKPOINTS
        self.done = setup.start_step  # completed steps
        self.last: Path | None = loaded_from
        self.saved_step: int | None = setup.start_step if loaded_from is not None else None
        self._mark_boundary()

    def __call__(self, step: int, row: dict, *rest: Any) -> None:
        self.done = step + 1
        s = self.setup
        every = s.cfg.run.checkpoint_every
        if (every and self.done % every == 0) or self.done == s.cfg.train.steps or s.should_stop():
            self.save()
        self._mark_boundary()

    def save(self) -> Path:
        s = self.setup
        flush = (self.run_dir / "metrics.jsonl", self.run_dir / "samples.jsonl")
        self.last = save_checkpoint(s, self.root, self.done, s.cfg.run.keep_checkpoints,
                                    reference_from=self.last, flush=flush)
        self.saved_step = self.done
        if s.services.progress is not None:
            s.services.progress.log(f"saved checkpoint {self.last}")
        for other in s.services.hooks:  # a hook with an on_save method hears of it (grpolab.api.callbacks)
            if other is not self and hasattr(other, "on_save"):
                other.on_save(self.done, self.last)
        return self.last

    def _mark_boundary(self) -> None:
        s = self.setup
        self._boundary = (rng_state(), copy.deepcopy(s.prompt_state()),
                          s.consecutive_skips, copy.deepcopy(s.optim.scheduler.state_dict()), _updates(s.optim.optimizer))

    def _back_to_boundary(self) -> bool:
        """When the policy has not been updated since the step began, puts back what Phase A and
        skipped optimizer steps changed (RNGs, data cursor, LR schedule, skip counter): the state
        is then exactly the step boundary. Returns whether it did."""
        s = self.setup
        rng, data, skips, sched, updates = self._boundary
        if _updates(s.optim.optimizer) != updates:
            return False
        set_rng_state(rng)
        if s.data.prefetch is not None:  # rollout.overlap: the step's prompts are drawn again on resume
            s.data.prefetch.drop()
        s.data.prompts.load_state_dict(data)
        s.optim.scheduler.load_state_dict(sched)
        s.consecutive_skips = skips
        return True

    def save_on_error(self) -> Path | None:
        """After an exception inside a step (a reward function raising, out of memory in
        generation): saves the step boundary when no update had happened in the step yet, so a
        resumed run redoes that step exactly. Returns the checkpoint, or None when the update had
        begun (half a step is not saved; the previous checkpoint stays the one to resume from)."""
        if not self._back_to_boundary():
            return None
        existing = self.root / f"step-{self.done}"
        return existing if is_complete(existing) else self.save()

    def save_last_good(self) -> Path:
        """After the numerics guard stopped the run inside a step: saves the last good state as
        step-<completed steps>: the step boundary when the step made no update (the usual case),
        else the weights of its last finite optimizer step. The skip counter is saved as 0, so a
        resumed run (e.g. with a lower train.lr) gets train.max_skipped_steps fresh tries."""
        self._back_to_boundary()
        self.setup.consecutive_skips = 0
        return self.save()


def _updates(optimizer: torch.optim.Optimizer) -> int:
    """How many parameter updates the optimizer has made (the sum of its per-parameter step counts)."""
    return sum(int(st["step"]) for st in optimizer.state.values() if "step" in st)
