"""Episodes run as coroutines: each `EpisodeDriver.run` in a thread of its own that hands every turn
request over and waits, so that a batch of episodes is sampled turn by turn in one decode
(grpolab.rollout.multiturn.py) while the between-turn logic stays the driver's own.

An episode may also `pause()` without a turn request: an environment call that runs elsewhere
(agents/envworkers.py) starts, pauses, and waits for its answer only once resumed, so the calls
of all the batch's episodes run at the same time. Paused episodes are resumed in episode order once
the others have run up to their next request; every round's requests reach `sample` in episode order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from grpolab.agents.driver import EpisodeDriver
from grpolab.agents.episode import Episode

PAUSED = object()
"""What `Coroutines._step` returns for an episode that paused."""
_current = threading.local()
"""In an episode thread: .coroutines, the Coroutines running it."""


def pause() -> None:
    """Lets the other episodes of the batch run until this one is resumed (module docstring). Called
    in an episode thread of a `Coroutines`; a no-op in any other thread."""
    owner = getattr(_current, "coroutines", None)
    if owner is not None:
        owner.pause()


class Abort(BaseException):
    """Raised in an episode thread's pending `generate` call when the batch is abandoned."""


class Slot:
    """One episode's thread and its hand-over fields (only one side touches them at a time)."""

    def __init__(self, index: int):
        self.index = index
        self.resume = threading.Semaphore(0)
        self.thread: threading.Thread | None = None
        self.request: tuple[list[int], int] | None = None
        self.reply: tuple[list[int], list[float]] | None = None
        self.episode: Episode | None = None
        self.error: BaseException | None = None
        self.abort = False
        self.waiting = False
        self.paused = False


class Coroutines:
    """Runs `driver.run(item)` for each episode in a thread used as a coroutine (module docstring).

    Hand-over: a thread runs only between `_step` releasing its `resume` and the thread releasing
    `yielded` (in `generate`, or when its run ends); the coordinating thread waits in between. So at
    most one of all these threads runs at any time, and the driver sees a plain blocking `generate`.
    """

    def __init__(self):
        self.yielded = threading.Semaphore(0)
        self.local = threading.local()
        self.slots: list[Slot] = []

    def generate(self, ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
        """The driver's `generate`, called in an episode's thread: hands the request over, waits for the turn."""
        slot = self.local.slot
        slot.request, slot.waiting = (list(ids), int(max_new_tokens)), True
        self.yielded.release()
        slot.resume.acquire()
        slot.waiting = False
        if slot.abort:
            raise Abort
        reply, slot.reply = slot.reply, None
        return reply

    def pause(self) -> None:
        """`pause()`, in an episode's thread: hands over without a request, waits to be resumed."""
        slot = self.local.slot
        slot.paused = slot.waiting = True
        self.yielded.release()
        slot.resume.acquire()
        slot.paused = slot.waiting = False
        if slot.abort:
            raise Abort

    def _body(self, slot: Slot, driver: EpisodeDriver, item: Any) -> None:
        self.local.slot = slot
        _current.coroutines = self
        try:
            slot.episode = driver.run(item)
        except Abort:
            pass
        except BaseException as e:  # noqa: BLE001 - re-raised by the coordinating thread
            slot.error = e
        finally:
            slot.request = None
            self.yielded.release()

    def _step(self, slot: Slot, driver: EpisodeDriver, item: Any, reply=None):
        """Runs `slot`'s episode until its next turn request (returned), a pause (PAUSED) or its end (None)."""
        if slot.thread is None:
            slot.thread = threading.Thread(target=self._body, args=(slot, driver, item), daemon=True,
                                           name=f"grpolab-episode-{slot.index}")
            slot.thread.start()
        else:
            slot.reply = reply
            slot.resume.release()
        self.yielded.acquire()
        if slot.error is not None:
            raise slot.error
        if slot.paused:
            return PAUSED
        request, slot.request = slot.request, None
        return request

    def run(self, driver: EpisodeDriver, items: Sequence[Any],
            sample: Callable[[dict[int, tuple[list[int], int]]], dict[int, tuple[list[int], list[float]]]]
            ) -> list[Episode]:
        """Every episode to its end: rounds of (each live episode up to its next request, in episode
        order; then `sample` answers all requests at once)."""
        self.slots = [Slot(i) for i in range(len(items))]
        requests = self._advance(driver, items, dict.fromkeys(range(len(items))))
        while requests:
            requests = self._advance(driver, items, sample(requests))
        for slot in self.slots:
            slot.thread.join()
        return [slot.episode for slot in self.slots]

    def _advance(self, driver: EpisodeDriver, items: Sequence[Any], replies: dict[int, Any]
                 ) -> dict[int, tuple[list[int], int]]:
        """Runs the episodes that `replies` names (each given its reply; None: starts it) in episode
        order, up to their next requests (returned, in episode order); those that pause are resumed
        after, in order, until none is left paused."""
        replies, requests, todo = dict(replies), {}, sorted(replies)
        while todo:
            paused = []
            for i in todo:
                request = self._step(self.slots[i], driver, items[i], replies.pop(i, None))
                if request is PAUSED:
                    paused.append(i)
                elif request is not None:
                    requests[i] = request
            todo = paused
        return dict(sorted(requests.items()))

    def close(self) -> None:
        """Ends the threads still waiting for a turn or paused (after an error): their `generate` or
        `pause` raises Abort."""
        for slot in self.slots:
            if slot.thread is not None and slot.thread.is_alive() and slot.waiting:
                slot.abort = True
                slot.resume.release()
                self.yielded.acquire()
                slot.thread.join()
