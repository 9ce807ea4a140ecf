"""rollout.overlap=K: the batches of the next K steps are generated and scored while this step learns.

    step k   Phase A: take batch k (submitted during an earlier step), then submit batches up to k+K
                      to the rollout workers, which hold weights k by then
             Phase B: learn on batch k                      | workers generate the batches in
             sync:    weights k+1 to the workers (queued    |   flight in submission order, then
                      behind the batches submitted so far)  |   score them (a background thread here)

The workers take calls in the order they arrive (grpolab/rollout/ray_engine.py), so a batch is
sampled by the weights of the last sync issued before it was submitted: batch k+K, submitted in
step k's Phase A, by weights k. After a start at step r (the first step, or the first after a
resume) nothing is in flight: batch r is generated in place (weights r), and batches r+1 .. r+K are
submitted at once, all with weights r; from then on one batch is submitted per step. Step r+j
thus learns on a batch `rollout/staleness` = min(j, K) weight versions old, never more than K; each
Rollout row records the version that sampled it (Rollout.weight_version, per token in
Rollout.versions where rows differ; an agent episode in Episode.weight_version), and the step logs
the mean and the max (`rollout/staleness_max`) over its rows. The importance ratio is taken
against the sampler's own log-probs, the behaviour policy's (grpo.loop.record_logprobs). With
K ≥ 2 the sync returns once the weights are sent (RayEngine.sync_wait) and the next sync waits for
it (at most one sync in flight): a slow batch is absorbed by one step of slack, whatever K ≥ 2 (a
larger K adds staleness, not slack). With K = 1 the sync waits until the workers hold the weights.

Batch k+j draws the prompts and the sampling seed step k+j would draw without overlap: the prompt
stream is read in step order, and each batch's sampling stream is seeded from (train.seed, rank,
step) as `Setup.seed_step` seeds it. A checkpoint stores the prompt stream as it was before the
earliest batch in flight (`prompt_state`), so a resumed run draws those prompts again.

Resume guarantee: a run resumed from the checkpoint written after step r-1 writes, from step r on,
exactly the metrics and samples of an uninterrupted run that calls `restart` at the end of step
r-1 (in-flight batches forgotten, the prompt stream put back before them): both generate step r's
batch in place from weights r and follow the staleness pattern min(j, K) above. It differs from a run
never interrupted only by that pattern (the same prompts and seeds, other weights sampling them).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from grpolab.parallel.launch import step_seed
from grpolab.agents.agent import episode_item
from grpolab.grpo.stats import StepStats


@dataclass
class _Pending:
    step: int
    future: Future
    stats: StepStats
    prompt_state: dict
    """The prompt stream's state before this step's prompts were drawn."""


class Prefetcher:
    """Holds the batches of up to `depth` (rollout.overlap) next steps in flight, in step order."""

    def __init__(self, depth: int = 1):
        if depth < 1:
            raise ValueError(f"Prefetcher: depth={depth} must be ≥ 1")
        self.depth = depth
        self.pending: deque[_Pending] = deque()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grpolab-overlap")

    @property
    def prompt_state(self) -> dict | None:
        """The prompt stream's state before the earliest batch in flight (for checkpoints); None when none is."""
        return self.pending[0].prompt_state if self.pending else None

    def take(self, s, st: StepStats):
        """Step st.step's batch: the one in flight (its timers and notes go to `st`), or generated now;
        then the batches of the steps up to st.step + depth are submitted."""
        from grpolab.grpo.dynamic_sampling import generate_batch

        if self.pending and self.pending[0].step == st.step:
            pending = self.pending.popleft()
            with st.timer("rollout_wait"):
                batch = pending.future.result()
            st.absorb(pending.stats)
        else:
            self.drop()
            batch = generate_batch(s, s.services.parallel.shard(s.data.prompts.next_batch(s.cfg.rollout.prompts_per_step)), st)
        for step in range(st.step + 1 + len(self.pending), st.step + 1 + self.depth):
            self.submit(s, step)
        return batch

    def submit(self, s, step: int) -> None:
        """Starts step `step`'s generation on the workers (queued behind what they were sent before: it
        samples the weights of the last sync) and its decoding and scoring in the background thread."""
        from grpolab.grpo.dynamic_sampling import generate_batch

        if step >= s.cfg.train.steps:
            return
        prompt_state = s.data.prompts.state_dict()
        items = s.services.parallel.shard(s.data.prompts.next_batch(s.cfg.rollout.prompts_per_step))
        gen = torch.Generator().manual_seed(step_seed(s.cfg.train.seed, s.services.parallel.rank, step, "sample"))
        if s.data.agent is not None:  # agent episodes, run by the workers
            in_flight = s.data.engine.submit_episodes([episode_item(it) for it in items], s.cfg.rollout.group_size,
                                                      s.data.agent.spec, generator=gen)
        else:
            in_flight = s.data.engine.submit([it.prompt for it in items], s.cfg.rollout.group_size, generator=gen)
        stats = StepStats(step)

        def finish():
            with torch.no_grad():  # grad mode is per thread
                return generate_batch(s, items, stats, in_flight=in_flight)

        self.pending.append(_Pending(step, self._thread.submit(finish), stats, prompt_state))

    def drop(self) -> None:
        """Forgets the batches in flight (their prompts are drawn again when the stream is put back)."""
        while self.pending:
            self.pending.pop().future.cancel()  # one not begun is not scored; the workers still generate it

    def restart(self, s) -> None:
        """Forgets the batches in flight and puts the prompt stream back before them: the next step
        starts the pipeline again, as a resumed run does (module docstring: resume guarantee)."""
        state = self.prompt_state
        self.drop()
        if state is not None:
            s.data.prompts.load_state_dict(state)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
