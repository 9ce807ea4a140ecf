"""rollout.overlap=1: the next step's batch is generated and scored while this step learns.

    step k   Phase A: take batch k (prefetched during step k-1's learning, sampled by weights k-1),
                      then submit batch k+1 to the rollout workers, which still hold weights k
             Phase B: learn on batch k                      | workers generate batch k+1 with
             sync:    weights k+1 to the workers (queued    |   weights k, then score it (a
                      behind batch k+1's generation)        |   background thread here)

A prefetched batch is one weight version behind the policy that learns on it (`rollout/staleness`
= 1; step 0, and the first step after a resume, are generated in place: 0), so the importance
ratio is taken against the sampler's own log-probs, the behaviour policy's (grpo.record_logprobs).
Batch k+1 draws the prompts and the sampling seed step k+1 would draw without overlap. A
checkpoint stores the prompt stream as it was before the prefetch, so a resumed run generates the
next step's prompts again, from the checkpoint's weights (staleness 0 for that step).
"""

from __future__ import annotations

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


class Prefetcher:
    """Holds the batch of the next step in flight (one at a time)."""

    def __init__(self):
        self.pending: _Pending | None = None
        self.prompt_state: dict | None = None
        """The prompt stream's state before the prefetched step's prompts were drawn (for checkpoints)."""
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grpolab-overlap")

    def take(self, s, st: StepStats):
        """Step st.step's batch: the prefetched one (its timers and notes go to `st`), or generated now;
        then the next step's is submitted."""
        from grpolab.grpo.dynamic_sampling import generate_batch

        pending, self.pending, self.prompt_state = self.pending, None, None
        if pending is not None and pending.step == st.step:
            with st.timer("rollout_wait"):
                batch = pending.future.result()
            st.absorb(pending.stats)
        else:
            batch = generate_batch(s, s.services.parallel.shard(s.data.prompts.next_batch(s.cfg.rollout.prompts_per_step)), st)
        self.submit(s, st.step + 1)
        return batch

    def submit(self, s, step: int) -> None:
        """Starts step `step`'s generation on the workers (now: with the weights they hold) and its
        decoding and scoring in the background thread."""
        from grpolab.grpo.dynamic_sampling import generate_batch

        if step >= s.cfg.train.steps:
            return
        self.prompt_state = s.data.prompts.state_dict()
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

        self.pending = _Pending(step, self._thread.submit(finish), stats)

    def drop(self) -> None:
        """Forgets the batch in flight (its prompts are drawn again when the stream is put back)."""
        self.pending, self.prompt_state = None, None

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
