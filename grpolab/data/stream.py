"""Seeded, resumable prompt streams for GRPO: each call gives the next batch of PromptItems.

A stream's `state_dict()` is its data cursor: saved in checkpoints so that a resumed run sees
exactly the prompts an uninterrupted run would have seen.
"""

from __future__ import annotations

import random
from typing import Iterator, Protocol, Sequence, TypeVar

from grpolab.data.arith import ArithTask, PromptItem


T = TypeVar("T")


def shuffled_batches(items: Sequence[T], batch_size: int, rng: random.Random) -> Iterator[list[T]]:
    """Endless batches walking seeded shuffles of `items` (reshuffled each pass). Used by SFT and
    reward-model training."""
    order: list[int] = []
    while True:
        batch = []
        while len(batch) < batch_size:
            if not order:
                order = list(range(len(items)))
                rng.shuffle(order)
            batch.append(items[order.pop()])
        yield batch


class PromptStream(Protocol):
    def next_batch(self, n: int) -> list[PromptItem]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class ArithStream:
    """Training-side prompts of the built-in task, drawn with a seeded RNG (with replacement)."""

    def __init__(self, task: ArithTask, seed: int):
        self.task = task
        self.rng = random.Random(seed)

    def next_batch(self, n: int) -> list[PromptItem]:
        return self.task.train_prompts(self.rng, n)

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        st = state["rng"]
        self.rng.setstate((st[0], tuple(st[1]), st[2]))


class ListStream:
    """A finite list of prompts, reshuffled each pass with a seeded permutation."""

    def __init__(self, items: Sequence[PromptItem], seed: int):
        if not items:
            raise ValueError("the prompt source is empty")
        self.items = list(items)
        self.seed = seed
        self.epoch = 0
        self.pos = 0
        self._order = self._perm()

    def _perm(self) -> list[int]:
        order = list(range(len(self.items)))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next_batch(self, n: int) -> list[PromptItem]:
        out = []
        while len(out) < n:
            if self.pos == len(self.items):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._perm()
            out.append(self.items[self._order[self.pos]])
            self.pos += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._order = self._perm()


SEED_EVAL_RANGE = 1_000_000
"""builtin:seeds: held-out items have seeds 0 .. SEED_EVAL_RANGE-1, training items seeds above."""


class SeedStream:
    """Items {"seed": k} for environments that build an episode from a seed (agents/builtin.py):
    training seeds drawn with a seeded RNG from [SEED_EVAL_RANGE, 2**31), never a held-out one."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def next_batch(self, n: int) -> list[PromptItem]:
        return [PromptItem("", {"seed": self.rng.randrange(SEED_EVAL_RANGE, 2**31)}) for _ in range(n)]

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        st = state["rng"]
        self.rng.setstate((st[0], tuple(st[1]), st[2]))


def held_out_seeds(n: int, start: int = 0) -> list[PromptItem]:
    """builtin:seeds' held-out items: {"seed": start}, ..., {"seed": start + n - 1} (below SEED_EVAL_RANGE)."""
    if start < 0 or start + n > SEED_EVAL_RANGE:
        raise ValueError(f"held-out seeds {start}..{start + n - 1} must lie in [0, {SEED_EVAL_RANGE})")
    return [PromptItem("", {"seed": k}) for k in range(start, start + n)]
