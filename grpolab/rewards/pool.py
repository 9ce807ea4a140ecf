"""Reward workers on Ray (`rollout.reward_workers=N`): the rewards scored away from the trainer.

Each `RewardWorker` actor builds the run's reward functions from the config (as the trainer does)
and runs up to rollout.reward_worker_threads calls at once. `RewardPool.score` sends each group of
G completions as a call of its own, groups dealt round-robin over the workers, so a verifier or
sandbox that takes a second per call costs about a second per batch, not a second per group. The
results are put back in row order; a function that raised on any group counts as raising on the
batch, so train.on_reward_error means the same as in one process. A worker that dies ends the run with
one WorkerLostError naming it (grpolab.parallel.ray_cluster.gather).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import torch

from grpolab.parallel.ray_cluster import connect, gather, require_ray


class RewardWorker:
    """A Ray actor scoring completions with the run's reward functions."""

    def __init__(self, cfg):
        from grpolab.parallel.launch import apply_threads
        from grpolab.rewards.registry import build_rewards

        apply_threads(cfg)
        self.rewards = build_rewards(cfg)

    def ready(self) -> list[str]:
        """The names of the rewards this worker built (once its constructor has run)."""
        return [fn.name for fn, _w in self.rewards]

    def score(self, prompts: list[str], texts: list[str], metas: list[dict]) -> dict[str, Any]:
        """name -> [n] float32 scores (NaN = abstained), or the exception the function raised."""
        from grpolab.rewards.base import score_batch

        out: dict[str, Any] = {}
        for fn, _w in self.rewards:
            try:
                out[fn.name] = score_batch(fn, prompts, texts, metas)
            except Exception as e:  # noqa: BLE001 - sent back to the trainer, which applies train.on_reward_error
                out[fn.name] = e
        return out


class RewardPool:
    """The reward workers of a run (module docstring)."""

    def __init__(self, workers: list, names: list[str]):
        self.workers, self.names = workers, names

    def score(self, prompts: Sequence[str], texts: Sequence[str], metas: Sequence[dict],
              group_size: int) -> dict[str, Any]:
        """name -> [N] scores of every row, or the first exception the function raised on a group."""
        refs, owners = [], []
        for g, start in enumerate(range(0, len(texts), group_size)):
            rows = slice(start, start + group_size)
            i = g % len(self.workers)
            refs.append(self.workers[i].score.remote(list(prompts[rows]), list(texts[rows]), list(metas[rows])))
            owners.append(f"reward worker {i} of {len(self.workers)}")
        parts = gather(refs, owners, "reward scoring")
        out: dict[str, Any] = {}
        for name in self.names:
            errors = [p[name] for p in parts if isinstance(p[name], BaseException)]
            out[name] = errors[0] if errors else torch.cat([p[name] for p in parts]) if parts else torch.zeros(0)
        return out

    def close(self) -> None:
        ray = require_ray()
        for w in self.workers:
            ray.kill(w)
        self.workers = []


def build_reward_pool(cfg, rewards: list, parallel) -> RewardPool:
    """rollout.reward_workers RewardWorker actors for this rank (each rank has its own: scoring
    needs no lockstep); `rewards` are the trainer's (RewardFn, weight) pairs, for their names."""
    ray = require_ray()
    r = cfg.rollout
    connect(cfg, r.workers + r.reward_workers + parallel.world_size)
    actor = ray.remote(RewardWorker)
    tag = uuid.uuid4().hex[:8]
    workers = [actor.options(name=f"grpolab-{tag}-reward-{parallel.rank}-{i}", num_cpus=0,
                             max_concurrency=r.reward_worker_threads).remote(cfg)
               for i in range(r.reward_workers)]
    pool = RewardPool(workers, [fn.name for fn, _w in rewards])
    try:  # every worker built the rewards before the first step (and a reward it cannot build is named now)
        ray.get([w.ready.remote() for w in workers])
    except ray.exceptions.RayError as e:
        pool.close()
        raise ValueError(f"rollout.reward_workers: a reward worker could not build the rewards "
                         f"{[spec.display_name for spec in cfg.rewards]}: {' '.join(str(e).split())[-400:]} "
                         "(a 'module:attr' reward must be importable on every node)") from None
    return pool
