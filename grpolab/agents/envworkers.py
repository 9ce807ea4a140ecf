"""Environment workers on Ray (`rollout.env_workers=N`): environments stepped away from the trainer.

`EnvPool` is an environment factory (`EpisodeDriver.make_environment`): each call makes a
`RemoteEnvironment`, one episode's environment, whose instance lives on one of N `EnvWorker`
actors (episodes dealt round-robin; its state stays there, an actor hosts many episodes'
instances). Its `reset` and `step` are calls on that actor: the call starts, the episode pauses
(agents/coroutines.py: the batch's other episodes run and start their own calls), and it waits for
the answer only when resumed. So the environment calls of a batch run at the same time, on the
actors and on each actor's threads (rollout.env_worker_threads), and a round waits for its slowest
call, not for the sum of them.

The actor runs the environment as the driver does in this process (the same protocol checks and
the same one-line description of an error), so an episode records the same results either way.
A call that does not answer within rollout.env_timeout_s (wall clock, from its start) ends its
episode as an environment error ("env_error"; train.on_reward_error applies), as does a call on an
actor that died or failed. Its actor is marked hung: it goes on serving its other episodes (their calls run
in threads of their own) until the batch ends (`end_batch`), then it is killed and a fresh one
started in its place (the next batch waits until it is ready: start-up does not count against a
call's limit), so later batches are not stuck behind the hung call. A thread of Python
cannot be stopped; the actor's process can.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Mapping

from grpolab.agents.coroutines import pause
from grpolab.agents.protocol import (EnvironmentFailure, Message, StepResult, as_step_result, check_messages,
                                     describe_error, load_environment)
from grpolab.parallel.ray_cluster import local_runtime_env, require_ray

DEFAULT_TIMEOUT_S = 60.0


class EnvWorker:
    """A Ray actor hosting environment instances of many episodes, by key. Each call answers
    (True, result) or (False, the error's one-line description): an error is data, not a Ray error."""

    def __init__(self, spec: str, kwargs: Mapping[str, Any]):
        self.make = load_environment(spec, kwargs)
        self.envs: dict[int, Any] = {}

    def ready(self) -> bool:
        return True

    def reset(self, key: int, item: Any) -> tuple[bool, Any]:
        """Makes the episode's environment and resets it for `item`: (True, opening messages)."""
        env = None
        try:
            env = self.make()
            self.envs[key] = env
            return True, check_messages(env.reset(item), f"{type(env).__name__}.reset")
        except Exception as e:  # noqa: BLE001 - user code: the episode records it
            return False, describe_error(e, type(env).__name__ if env else "environment")

    def step(self, key: int, message: Message) -> tuple[bool, Any]:
        """The episode's environment's step: (True, StepResult)."""
        env = self.envs[key]
        try:
            return True, as_step_result(env.step(message), type(env).__name__)
        except Exception as e:  # noqa: BLE001 - user code: the episode records it
            return False, describe_error(e, type(env).__name__)

    def drop(self, keys: list[int]) -> None:
        """Forgets the environments of ended episodes."""
        for key in keys:
            self.envs.pop(key, None)


class RemoteEnvironment:
    """One episode's environment on an env worker (module docstring); an `Environment`."""

    def __init__(self, pool: "EnvPool", worker: int, actor: Any, key: int):
        self.pool, self.worker, self.actor, self.key = pool, worker, actor, key

    def reset(self, item: Any) -> list[Message]:
        return self.pool.call(self, "reset", item)

    def step(self, message: Message) -> StepResult:
        return self.pool.call(self, "step", message)


class EnvPool:
    """The env workers of a process and the episodes' environments on them; a zero-argument
    environment factory. spec / kwargs: the environment class ('pkg.mod:Class') and its constructor's
    keyword arguments; workers: how many actors; timeout_s: the limit of one call, in seconds;
    threads: calls one actor runs at once. The actors start at the first episode (`start`)."""

    def __init__(self, spec: str, kwargs: Mapping[str, Any], workers: int, timeout_s: float = DEFAULT_TIMEOUT_S,
                 threads: int = 32):
        if workers < 1 or not timeout_s > 0 or threads < 1:
            raise ValueError(f"EnvPool: workers ({workers}), timeout_s ({timeout_s}) and threads ({threads}) "
                             "must be positive")
        self.spec, self.kwargs, self.size = spec, dict(kwargs), workers
        self.timeout_s, self.threads = float(timeout_s), threads
        self.label = spec.rpartition(":")[2].rpartition(".")[2]
        self.actors: list[Any] = []
        self.hosted: list[list[int]] = [[] for _ in range(workers)]
        """Per actor: the keys of the environments it holds."""
        self.hung: set[int] = set()
        """Actors with a call past its time limit (or dead): replaced at `end_batch`."""
        self.starting: dict[int, Any] = {}
        """Actors started and not yet known ready: place -> its `ready` call."""
        self.made = 0
        """Environments made (one per episode); the next one's key."""
        self.restarts = 0
        """Actors killed and started afresh (after a call timed out or the actor died)."""
        self.timeouts = 0
        """Calls that ran past timeout_s."""
        self._lock = threading.RLock()

    def __call__(self) -> RemoteEnvironment:
        with self._lock:
            self.start()
            key, self.made = self.made, self.made + 1
            worker = key % self.size
            self.hosted[worker].append(key)
            return RemoteEnvironment(self, worker, self.actors[worker], key)

    def start(self) -> None:
        """Starts the actors if they are not (joining this process's Ray cluster, else starting a local
        one) and waits until every actor started is ready: start-up never counts against a call's limit."""
        ray = require_ray()
        with self._lock:
            if not self.actors:
                if not ray.is_initialized():
                    ray.init(include_dashboard=False, log_to_driver=True, runtime_env=local_runtime_env())
                self.actors = [self._start(i) for i in range(self.size)]
            if not self.starting:
                return
            try:
                ray.get(list(self.starting.values()))
            except ray.exceptions.RayError as e:
                self.close()
                raise RuntimeError(f"rollout.env_workers: an env worker could not load environment {self.spec!r}: "
                                   f"{' '.join(str(e).split())[-400:]} (its module must be importable on every "
                                   "node)") from None
            self.starting.clear()

    def call(self, env: RemoteEnvironment, method: str, arg: Any) -> Any:
        """Runs `method`(key, arg) on the episode's actor (module docstring): its result, or
        EnvironmentFailure describing the error, the time limit or the actor's death."""
        ref = getattr(env.actor, method).remote(env.key, arg)
        deadline = time.monotonic() + self.timeout_s
        pause()
        ok, value = self._wait(ref, env.worker, method, deadline)
        if not ok:
            raise EnvironmentFailure(value)
        return value

    def _wait(self, ref, worker: int, method: str, deadline: float) -> tuple[bool, Any]:
        ray = require_ray()
        try:
            return ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError:
            self._mark_hung(worker, timed_out=True)
            return False, (f"{self.label}.{method} did not answer within {self.timeout_s:g} s (rollout.env_timeout_s); "
                           f"env worker {worker} is replaced after this batch")
        except ray.exceptions.RayError as e:  # the actor died (RayActorError), or failed outside the environment
            self._mark_hung(worker)
            return False, f"{self.label}.{method}: env worker {worker} failed: {' '.join(str(e).split())[:200]}"

    def _mark_hung(self, worker: int, timed_out: bool = False) -> None:
        with self._lock:
            self.hung.add(worker)
            self.timeouts += timed_out

    def end_batch(self) -> None:
        """After every episode made so far has ended: their environments are dropped, and each hung
        actor is killed and a fresh one started in its place."""
        ray = require_ray()
        with self._lock:
            for i, actor in enumerate(self.actors):
                keys, self.hosted[i] = self.hosted[i], []
                if i in self.hung:
                    ray.kill(actor)
                    self.actors[i] = self._start(i)  # ready by the next batch, which waits for it
                    self.restarts += 1
                elif keys:
                    actor.drop.remote(keys)
            self.hung.clear()

    def close(self) -> None:
        """Ends the actors (a later episode starts new ones)."""
        with self._lock:
            if self.actors:
                ray = require_ray()
                for actor in self.actors:
                    ray.kill(actor)
            self.actors, self.hosted, self.hung = [], [[] for _ in range(self.size)], set()
            self.starting.clear()

    def _start(self, index: int):
        """A new actor for place `index` (its readiness awaited by `start`)."""
        ray = require_ray()
        actor = ray.remote(EnvWorker).options(num_cpus=0, max_concurrency=self.threads).remote(self.spec, self.kwargs)
        self.starting[index] = actor.ready.remote()
        return actor
