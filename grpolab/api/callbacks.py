"""Callbacks of a GRPO run: the training loop's hooks (Setup.services.hooks, as `ablate` uses them),
with names.

    class EarlyStop(grpolab.Callback):
        def on_step_end(self, step, metrics):
            return metrics["reward/mean"] > 0.9      # True: stop after this step, saved, resumable

A callback is any object with some of these methods (each returns True to stop the run, anything else
to go on):

- `on_rollout(step, record)`: the step's rollout as the run directory's samples.jsonl has it (a
  grpolab.grpo.stats.StepRecord: items, texts, scores per reward, rewards, advantages), after the step;
- `on_step_end(step, metrics)`: the step's metrics row (what metrics.jsonl gets);
- `on_evaluate(step, metrics)`: the held-out evaluation every run.eval_every steps (its metrics, the
  `eval/` keys of the row without the prefix);
- `on_save(step, checkpoint)`: after a checkpoint (its folder) is written.

A stop takes the path of SIGTERM (grpolab.grpo.signals.StopSignal.request): the step is finished, a
checkpoint saved, and `train(..., resume=True)` (or `grpolab train ... --resume`) continues the run.
Callbacks run on every rank of a torchrun launch; a stop on any rank stops all of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpolab.grpo.eval_hook import EVAL_PREFIX


class Callback:
    """A base class with every method doing nothing; subclass and override the ones you need."""

    def on_rollout(self, step: int, record: Any) -> bool | None:
        return None

    def on_step_end(self, step: int, metrics: dict) -> bool | None:
        return None

    def on_evaluate(self, step: int, metrics: dict) -> bool | None:
        return None

    def on_save(self, step: int, checkpoint: Path) -> bool | None:
        return None


class CallbackHook:
    """The Setup hook that calls the callbacks (appended to setup.services.hooks before the run
    directory's writers, so a metrics row is complete when on_step_end sees it)."""

    def __init__(self, callbacks: list[Any]):
        self.callbacks = list(callbacks)
        self.setup = None
        self.stopped_by = ""
        """The first callback method that asked to stop ("EarlyStop.on_step_end"); empty while none has."""
        for cb in self.callbacks:
            if not any(callable(getattr(cb, m, None)) for m in ("on_rollout", "on_step_end", "on_evaluate", "on_save")):
                raise TypeError(f"callbacks: {cb!r} has none of on_rollout, on_step_end, on_evaluate, on_save")

    def attach(self, setup) -> "CallbackHook":
        self.setup = setup
        return self

    def __call__(self, step: int, row: dict, record: Any) -> None:
        evaluated = {k[len(EVAL_PREFIX):]: v for k, v in row.items() if k.startswith(EVAL_PREFIX)}
        self._each("on_rollout", step, record)
        if evaluated:
            self._each("on_evaluate", step, evaluated)
        self._each("on_step_end", step, row)

    def on_save(self, step: int, checkpoint: Path) -> None:
        self._each("on_save", step, checkpoint)

    def _each(self, method: str, *args: Any) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, method, None)
            if fn is not None and fn(*args) is True:
                self._stop(f"{type(cb).__name__}.{method}")

    def _stop(self, reason: str) -> None:
        stop = self.setup.services.stop if self.setup is not None else None
        if stop is None:
            raise RuntimeError(f"{reason} asked to stop, but the run has no stop switch (not run by grpolab.api.train)")
        self.stopped_by = self.stopped_by or reason
        stop.request(reason)
