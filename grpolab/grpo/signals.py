"""Graceful stop on SIGTERM / SIGINT: finish the current step, save a checkpoint, exit.

    with StopSignal() as stop:
        setup.services.stop = stop               # Setup.should_stop() reads stop.requested
        grpo.train(setup)               # the loop breaks after the step in which a signal came

The first SIGTERM or SIGINT (Ctrl-C) only sets a flag and prints one line saying what will happen.
The loop checks the flag between GRPO steps: the step that is running is finished (a partly done
step cannot be resumed exactly: its rollout is not saved), the checkpoint hook saves, and the run
exits. A second signal gives up at once (KeyboardInterrupt): that step is lost, the previous
checkpoint stays usable. Handlers can only be installed from the main thread; elsewhere (a Ray
trainer actor runs the loop in a thread of its own) `request_stop` stands in for the signal.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Self, TextIO

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
    """Context manager: installs the handlers on enter, restores the previous ones on exit."""

    def __init__(self, stream: TextIO | None = None):
        self.requested = False
        self.signum, self.signame = 0, ""
        self.reason = ""
        """Set by `request`: what asked for the stop in code (a callback), not a signal."""
        self.stream = stream
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            raise KeyboardInterrupt(f"second {name}: stopping without finishing the step")
        self.requested, self.signum, self.signame = True, signum, name
        print(f"grpolab: got {name}; finishing the current step, then saving a checkpoint and exiting "
              f"(send it again to stop at once)", file=self.stream or sys.stderr, flush=True)

    def request(self, reason: str) -> None:
        """A stop asked for in code (a callback, grpolab.api.callbacks): the same path as a signal, the
        step finished, a checkpoint saved, the run resumable; `reason` names the asker in the last line."""
        if not self.requested:
            print(f"grpolab: {reason} asked to stop; finishing the current step, then saving a checkpoint",
                  file=self.stream or sys.stderr, flush=True)
        self.requested, self.reason = True, self.reason or reason

    def __enter__(self) -> Self:
        _ACTIVE.append(self)
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


_ACTIVE: list[StopSignal] = []


def request_stop(signum: int = signal.SIGTERM) -> bool:
    """What `signum` arriving would do, for every StopSignal in force in this process (from any
    thread: `grpolab train --ray` forwards the driver's signals to its trainer actors this way).
    Returns whether one was in force."""
    for stop in list(_ACTIVE):
        stop._handle(signum, None)
    return bool(_ACTIVE)
