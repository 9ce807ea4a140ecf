"""Rollout workers on Ray (`rollout.workers=N`): an `Engine` whose generation runs in N actors.

Each `RolloutWorker` actor builds the run's own engine (`rollout.engine`: hf on CPUs or GPUs, vllm
on GPUs) on a copy of the policy it loads from the config, prepared exactly as the trainer prepares
its own (attention, compute dtype, threads), so one worker samples what the in-process engine would.
`RayEngine.generate` spreads whole groups over the workers (contiguous shares of the prompts, at
most one share per worker) and concatenates their Rollouts in prompt order; `submit_episodes` does
the same with agent episodes (each worker loads the environment and tools itself, once, from the
AgentSpec it is sent, and runs its share's episodes turn by turn). Sampling streams:
worker 0 continues the caller's torch.Generator (its state travels and comes back), so one worker
draws exactly what the in-process engine draws; worker i > 0 (and a GPU worker 0) draws from a
seed hashed from that state (or from a draw of a GPU generator) and i.

Weight sync (`load_weights`, after each optimizer phase): rank 0 puts the policy's state dict in
Ray's object store once (CPU tensors) and every worker copies it into its model through its
engine's own `load_weights` (vLLM: its weight-loading path); the call returns when every worker
holds the new version; the loop times it (`sync/seconds`) and the bytes sent are kept
(`sync/bytes`); with rollout.overlap ≥ 2 it returns once the weights are sent (`sync_wait`), so
the trainer does not wait for the batches queued before the sync. Workers take calls in the order
they arrive (one thread each), so a generation submitted before a sync samples from the weights
before it: that is how rollout.overlap=K runs up to K versions behind (grpolab/grpo/overlap.py).
Every Rollout carries the weight version that sampled it (every episode too, where workers'
batches are merged).

Actors are named per run (`grpolab-<token>-rollout-<i>`): rank 0 creates them, other trainer ranks
look them up, and `close()` ends them. A worker that dies (killed, its process ended) ends the run with
one WorkerLostError naming it and how to continue (`--resume`), not Ray's ActorDiedError traceback.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from grpolab.agents.episode import EpisodeBatch
from grpolab.batch import Rollout, concat_rollouts
from grpolab.parallel.ray_cluster import connect, gather, require_ray
from grpolab.rollout.hf import pad_id
from grpolab.rollout.multiturn import generate_episodes


class RolloutWorker:
    """A Ray actor holding one generation engine and its own copy of the policy's weights."""

    def __init__(self, cfg):
        from grpolab.forward import LogProbForward
        from grpolab.rollout.engine import build_engine
        from grpolab.parallel.launch import apply_threads
        from grpolab.models.policy import load_policy
        from grpolab.models.loading import resolve_compute_dtype

        apply_threads(cfg)
        device = "cuda" if cfg.rollout.worker_gpus > 0 else "cpu"
        cfg = cfg.replace(**{"model.device": device, "rollout.workers": 0, "rollout.overlap": 0})
        self.model, self.tokenizer = load_policy(cfg)
        dtype = resolve_compute_dtype(cfg.model.dtype, device)
        LogProbForward.from_config(cfg, dtype).prepare(self.model)  # the attention the trainer's policy uses
        self.engine = build_engine(cfg, self.model, self.tokenizer, dtype)
        self.device = device
        self.agents: dict[str, Any] = {}
        """Loaded agents (environment factory, tool worker) by repr(AgentSpec)."""

    def generate(self, prompts: list[str], group_size: int, gen_state: bytes | None, seed: int,
                 greedy: bool) -> tuple[Rollout, bytes | None]:
        """The engine's Rollout of `prompts` (CPU tensors), sampled from a generator set to `gen_state`
        on a CPU worker (else seeded with `seed`), and the generator's state after it (CPU)."""
        gen = self._generator(gen_state, seed)
        ro = _to_cpu(self.engine.generate(prompts, group_size, generator=gen, greedy=greedy))
        return ro, state_bytes(gen) if self.device == "cpu" else None

    def episodes(self, items: list, group_size: int, spec, gen_state: bytes | None, seed: int,
                 greedy: bool) -> tuple[EpisodeBatch, bytes | None]:
        """G agent episodes of each item (rollout/multiturn.py) with the agent `spec` (an AgentSpec,
        loaded once per spec), sampled as `generate` samples; and the generator's state after it."""
        key = repr(spec)
        if key not in self.agents:
            self.agents[key] = spec.build()
        gen = self._generator(gen_state, seed)
        batch = generate_episodes(self.engine, items, group_size, generator=gen, greedy=greedy,
                                  **self.agents[key].driver_kwargs())
        return batch, state_bytes(gen) if self.device == "cpu" else None

    def _generator(self, gen_state: bytes | None, seed: int) -> torch.Generator:
        gen = torch.Generator(device=self.device)
        if gen_state is not None and self.device == "cpu":
            set_state_bytes(gen, gen_state)
        else:
            gen.manual_seed(seed)
        return gen

    def load_weights(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        """Copies `state` into the engine's model."""
        self.engine.load_weights(version, state)

    def weight_version(self) -> int:
        return int(self.engine.weight_version)

    def state_checksum(self) -> float:
        """Σ of every weight (float64): a cheap fingerprint of the weights the worker samples from."""
        with torch.no_grad():
            return float(sum(p.double().sum() for p in self.model.state_dict().values()))


def state_bytes(gen: torch.Generator) -> bytes:
    """A CPU generator's state, as bytes to send to an actor."""
    return bytes(gen.get_state().numpy())


def set_state_bytes(gen: torch.Generator, state: bytes) -> None:
    gen.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))


def _hash_seed(state: bytes, index: int) -> int:
    return int.from_bytes(hashlib.blake2b(state + index.to_bytes(4, "little"), digest_size=8).digest(), "little") \
        & (2**63 - 1)


def _to_cpu(ro: Rollout) -> Rollout:
    fields = {k: v.cpu() for k, v in vars(ro).items() if isinstance(v, torch.Tensor)}
    return ro.replace(**fields)


def split_groups(n_prompts: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) shares of n_prompts prompts over at most `parts` workers, sizes
    differing by at most one, none empty (fewer shares when there are fewer prompts)."""
    parts = max(1, min(parts, n_prompts))
    base, extra = divmod(n_prompts, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


@dataclass
class PendingRollout:
    """A generation in flight on the workers; `result()` waits for it and returns the Rollout
    (episodes: the EpisodeBatch of every worker's episodes, in item order)."""

    refs: list
    pad_id: int
    generator: torch.Generator | None = None
    episodes: bool = False
    owners: list[str] = field(default_factory=list)
    """Who runs refs[i] (`RayEngine.owners`), named when it dies."""
    _done: Rollout | EpisodeBatch | None = field(default=None, repr=False)

    def result(self) -> Rollout | EpisodeBatch:
        if self._done is None:
            outs = gather(self.refs, self.owners, "generation")
            if self.generator is not None and outs[0][1] is not None:  # worker 0 continued the caller's stream
                set_state_bytes(self.generator, outs[0][1])
            parts = [part for part, _ in outs]
            self._done = merge_episodes(parts) if self.episodes else \
                parts[0] if len(parts) == 1 else concat_rollouts(parts, self.pad_id)
        return self._done


def merge_episodes(parts: list[EpisodeBatch]) -> EpisodeBatch:
    """The workers' EpisodeBatches as one, in order (their engine counters summed; the oldest weight
    version, and each episode keeps its own in Episode.weight_version)."""
    stats: dict[str, int] = {}
    for p in parts:
        for k, v in p.stats.items():
            stats[k] = stats.get(k, 0) + v
        for e in p.episodes:
            e.weight_version = p.weight_version if e.weight_version is None else e.weight_version
    return EpisodeBatch([e for p in parts for e in p.episodes], parts[0].group_size, parts[0].pad_id,
                        min(p.weight_version for p in parts), stats)


class RayEngine:
    """`Engine` over Ray rollout-worker actors (module docstring)."""

    def __init__(self, workers: list, tokenizer, is_main: bool = True, names: Sequence[str] = ()):
        self.workers, self.tokenizer, self.is_main = workers, tokenizer, is_main
        self.names = list(names)
        self.weight_version = 0
        self.last_sync_bytes = 0
        self.sync_wait = True
        """load_weights waits until every worker holds the new weights; False (rollout.overlap ≥ 2): it
        returns once they are sent, and the next sync (or `versions`) waits for this one."""
        self._syncing: list = []

    def submit(self, prompts: Sequence[str], group_size: int, *, generator: torch.Generator | None = None,
               greedy: bool = False) -> PendingRollout:
        """Starts the generation of G completions per prompt on the workers; returns at once."""
        return self._spread("generate", prompts, (group_size,), generator, greedy)

    def submit_episodes(self, items: Sequence, group_size: int, spec, *, generator: torch.Generator | None = None,
                        greedy: bool = False) -> PendingRollout:
        """Starts G agent episodes per item (spec: an agents.agent.AgentSpec) on the workers, whole
        groups spread as `submit` spreads prompts; returns at once. `.result()` is an EpisodeBatch."""
        return self._spread("episodes", items, (group_size, spec), generator, greedy)

    def _spread(self, method: str, inputs: Sequence, args: tuple, generator, greedy: bool) -> PendingRollout:
        """Calls worker method `method`(share of inputs, *args, generator state or None, seed, greedy) on
        contiguous shares of `inputs` (module docstring: sampling streams)."""
        cpu = generator is not None and generator.device.type == "cpu"
        state = state_bytes(generator) if cpu else None
        base = state if cpu else str(int(torch.randint(0, 2**62, (1,), generator=generator,
                                                         device=generator.device if generator else "cpu"))).encode()
        refs = []
        for i, (a, b) in enumerate(split_groups(len(inputs), len(self.workers))):
            call = getattr(self.workers[i], method)
            refs.append(call.remote(list(inputs[a:b]), *args, state if i == 0 else None, _hash_seed(base, i), greedy))
        return PendingRollout(refs, pad_id(self.tokenizer), generator, episodes=method == "episodes",
                              owners=self.owners())

    def owners(self) -> list[str]:
        """Each worker as a message names it: "rollout worker I of N (Ray actor NAME)"."""
        n = len(self.workers)
        return [f"rollout worker {i} of {n}" + (f" (Ray actor {self.names[i]})" if i < len(self.names) else "")
                for i in range(n)]

    def generate(self, prompts: Sequence[str], group_size: int, *, generator: torch.Generator | None = None,
                 greedy: bool = False) -> Rollout:
        """`Engine.generate`, on the workers."""
        return self.submit(prompts, group_size, generator=generator, greedy=greedy).result()

    def decode(self, rollout: Rollout) -> list[str]:
        from grpolab.rollout.hf import decode_completions

        return decode_completions(self.tokenizer, rollout)

    def load_weights(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        """`Engine.load_weights`: rank 0 sends `state` to every worker and waits until all hold it;
        other ranks only read it (an FSDP2 state is gathered collectively) and record the version."""
        ray = require_ray()
        if self.is_main:
            self.finish_sync()  # at most one sync in flight
            cpu = {k: state[k].detach().cpu() for k in state}  # put copies them into the object store
            ref = ray.put(cpu)
            self._syncing = [w.load_weights.remote(version, ref) for w in self.workers]
            if self.sync_wait:
                self.finish_sync()
            self.last_sync_bytes = sum(v.numel() * v.element_size() for v in cpu.values())
        elif not isinstance(state, dict):  # gathered as read (FSDP2): every rank reads it, in the same order
            for k in state:
                state[k]
        self.weight_version = version

    def finish_sync(self) -> None:
        """Waits until every worker holds the weights of the last `load_weights` (see sync_wait)."""
        refs, self._syncing = self._syncing, []
        if refs:
            gather(refs, self.owners(), "a weight sync")

    def versions(self) -> list[int]:
        """Each worker's weight version."""
        self.finish_sync()
        return gather([w.weight_version.remote() for w in self.workers], self.owners(), "a version check")

    def close(self) -> None:
        """Ends the workers (rank 0, which created them)."""
        if self.is_main:
            ray = require_ray()
            for w in self.workers:
                ray.kill(w)
        self.workers = []


def _placement(cfg, index: int) -> dict:
    """Colocated mode (a fraction of a GPU per worker, trainer ranks placed by `grpolab train --ray`):
    worker `index` goes in trainer bundle index mod ranks, on that rank's GPU; else Ray places it."""
    from ray.util import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = get_current_placement_group()
    if pg is None or not 0 < cfg.rollout.worker_gpus < 1 or not cfg.model.device.startswith("cuda"):
        return {}
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index % pg.bundle_count)}


def build_ray_engine(cfg, policy, tokenizer, parallel) -> RayEngine:
    """rollout.workers RolloutWorker actors (created by rank 0, named for this run, looked up by the
    other ranks), loaded with `policy`'s weights as version 0 before the first rollout."""
    ray = require_ray()
    r = cfg.rollout
    connect(cfg, r.workers + r.reward_workers + parallel.world_size)
    token = parallel.broadcast(uuid.uuid4().hex[:8])
    names = [f"grpolab-{token}-rollout-{i}" for i in range(r.workers)]
    if parallel.is_main:
        actor = ray.remote(RolloutWorker)
        workers = [actor.options(name=n, num_cpus=1, num_gpus=r.worker_gpus, **_placement(cfg, i)).remote(cfg)
                   for i, n in enumerate(names)]
    parallel.barrier()
    if not parallel.is_main:
        workers = [ray.get_actor(n) for n in names]
    engine = RayEngine(workers, tokenizer, is_main=parallel.is_main, names=names)
    engine.load_weights(0, parallel.full_state(policy))  # the trainer's π0 (an SFT'd policy, LoRA adapters)
    engine.sync_wait = r.overlap < 2  # the workers queue a sync behind the batches in flight (grpo/overlap.py)
    return engine
