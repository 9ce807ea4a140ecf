"""Phase A's draw of a step's groups: one batch of prompts, or DAPO's dynamic sampling.

DAPO (Yu et al. 2025, §3.2 "Dynamic Sampling"; verl's `algorithm.filter_groups` {enable, metric,
max_num_gen_batches}, recipe/dapo): a group whose G rewards are all equal has advantage 0 and
gives the policy gradient nothing, so it is dropped, and further batches of prompts are generated
and scored until the step holds rollout.prompts_per_step groups with unequal rewards; the surplus
of the last batch is cut off. Here:

- every batch is rollout.prompts_per_step prompts from the prompt stream (verl's gen_batch_size is
  that size), sampled from the step's seeded stream (`Setup.seed_step`), so a resumed step draws
  the same prompts and completions as the uninterrupted one;
- the spread is that of the weighted reward sum, or of the reward named by
  rollout.dynamic_sampling_reward (verl's metric), over the rows that scored (`zero_std_groups`);
- rollout.max_generation_batches caps the batches, the first included (0 = no limit). verl raises
  at the cap; here the step goes on: the earliest dropped groups fill the remaining places (the
  batch keeps its size, so the minibatch sizes still divide it) and a console note says so;
- on several ranks every rank draws every batch (the prompt streams' cursors stay equal, and a
  resume stays exact) and keeps its own contiguous share (`Parallel.shard`); a rank whose P / world
  groups are full only draws, and all stop together when no rank is short (`Parallel.any`).

The step's metrics describe the kept groups; `rollout/gen_batches` and `rollout/dropped_groups`
count the batches drawn and the groups of equal rewards left out.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from grpolab.algo.advantages import zero_std_groups
from grpolab.rollout.hf import pad_id
from grpolab.batch import Rollout, concat_rollouts
from grpolab.agents.episode import scoring_inputs
from grpolab.grpo.episodes import apply_env_errors, episode_rows, sample_episodes
from grpolab.grpo.stats import StepStats, score_rollout


class Batch(NamedTuple):
    """A rank's scored groups: prompts, their G completions each, and the scores."""

    items: list
    rollout: Rollout
    """[N = len(items) × G rows]; rewards and advantages not set yet."""
    texts: list[str]
    scores: dict[str, torch.Tensor]
    """reward name -> [N] (NaN = abstained)."""
    rewards: torch.Tensor
    """[N] weighted sum of the scores."""
    episodes: list | None = None
    """Agent runs: [N] each episode's counts and segments (grpo.episodes.episode_rows); None otherwise."""

    def groups(self, idx: list[int]) -> "Batch":
        """The groups `idx` (in that order), whole."""
        G = self.rollout.group_size
        rows = torch.tensor([g * G + j for g in idx for j in range(G)], dtype=torch.long)
        episodes = None if self.episodes is None else [self.episodes[i] for i in rows.tolist()]
        return Batch([self.items[g] for g in idx], self.rollout.select(rows), [self.texts[i] for i in rows.tolist()],
                     {k: v[rows] for k, v in self.scores.items()}, self.rewards[rows], episodes)


def draw_batch(s, st: StepStats) -> Batch:
    """This rank's groups of the step: its share of the next prompts_per_step prompts, generated and
    scored; with rollout.dynamic_sampling, only groups whose rewards differ (`dynamic_batch`)."""
    r = s.cfg.rollout
    if r.dynamic_sampling:
        batch = dynamic_batch(s, st)
    elif s.data.prefetch is not None:  # rollout.overlap: prefetched while the last step learned
        batch = s.data.prefetch.take(s, st)
    else:
        batch = generate_batch(s, s.services.parallel.shard(s.data.prompts.next_batch(r.prompts_per_step)), st)
    st.set_staleness(s.data.engine.weight_version - batch.rollout.row_versions())
    return batch


def generate_batch(s, items: list, st: StepStats, in_flight=None) -> Batch:
    """G completions of each prompt of `items`, sampled from the step's stream, decoded and scored.
    in_flight: their generation, already submitted to the rollout workers (rollout.overlap; this then
    runs in a background thread and leaves the progress display alone)."""
    show = s.services.progress.phase if in_flight is None else (lambda *a: None)
    if s.data.agent is not None:
        return episode_batch(s, items, st, in_flight, show)
    with st.timer("rollout"):
        show("rollout")
        if in_flight is not None:
            ro = in_flight.result()
        else:
            ro = s.data.engine.generate([it.prompt for it in items], s.cfg.rollout.group_size, generator=s.data.sample_gen)
        texts = s.data.engine.decode(ro)
    with st.timer("score"):
        show("score")
        scores, rewards = score_rollout(s.data.rewards, items, texts, ro, s.on_reward_error, st, s.cfg.rollout.max_new_tokens,
                                        s.data.reward_pool)
    return Batch(list(items), ro, texts, scores, rewards)


def episode_batch(s, items: list, st: StepStats, in_flight, show) -> Batch:
    """`generate_batch` for agent runs: G episodes per item (grpo/episodes.py), scored by the
    environment's reward and the reward functions."""
    with st.timer("rollout"):
        show("rollout")
        episodes = sample_episodes(s, items, s.data.sample_gen, in_flight)
        ro = episodes.rollout()
    with st.timer("score"):
        show("score")
        decode = s.models.tokenizer.decode
        prompts, texts, metas = scoring_inputs(episodes.episodes, decode)
        apply_env_errors(episodes, items, metas, s.on_reward_error, st)
        scores, rewards = score_rollout(s.data.rewards, items, texts, ro, s.on_reward_error, st, s.cfg.rollout.max_new_tokens,
                                        s.data.reward_pool, prompts=prompts, row_meta=metas)
    return Batch(list(items), ro, texts, scores, rewards, episode_rows(episodes, decode))


def has_signal(batch: Batch, reward: str = "") -> torch.Tensor:
    """[groups] bool: the group's rewards differ — of the weighted sum, or of the reward named `reward`."""
    values = batch.scores[reward] if reward else batch.rewards
    return ~zero_std_groups(values.view(-1, batch.rollout.group_size))


def dynamic_batch(s, st: StepStats) -> Batch:
    """DAPO's dynamic sampling (module docstring): batches of prompts_per_step prompts until this
    rank holds prompts_per_step / world groups with unequal rewards, in lockstep with the other ranks."""
    r, par = s.cfg.rollout, s.services.parallel
    want = r.prompts_per_step // par.world_size
    batches: list[Batch] = []
    signals: list[torch.Tensor] = []
    drawn = 0
    while True:
        items = par.shard(s.data.prompts.next_batch(r.prompts_per_step))  # every rank draws: equal cursors
        drawn += 1
        if kept_count(signals) < want:  # a full rank only draws
            batches.append(generate_batch(s, items, st))
            signals.append(has_signal(batches[-1], r.dynamic_sampling_reward))
        if drawn == r.max_generation_batches or not par.any(kept_count(signals) < want):
            break
    picks = pick_groups(signals, want)
    filled = sum(1 for b, g in picks if not signals[b][g])
    st.gen_batches = drawn
    st.dropped_groups = sum(len(sig) - int(sig.sum()) for sig in signals) - filled
    if filled:
        masked = "; loss.filter_zero_std_groups masks those whose rewards are all equal" \
            if s.cfg.loss.filter_zero_std_groups else ""
        st.notes.append(f"dynamic sampling: rollout.max_generation_batches={r.max_generation_batches} batches gave "
                        f"{want - filled} of {want} groups with unequal rewards; {filled} dropped ones fill the rest{masked}")
    parts = [batches[b].groups([g for bb, g in picks if bb == b]) for b in sorted({b for b, _ in picks})]
    return concat_batches(parts, pad_id(s.models.tokenizer))


def kept_count(signals: list[torch.Tensor]) -> int:
    """Groups with unequal rewards among the batches generated so far."""
    return sum(int(sig.sum()) for sig in signals)


def pick_groups(signals: list[torch.Tensor], want: int) -> list[tuple[int, int]]:
    """(batch, group) of the first `want` groups with a signal, in draw order; when there are fewer
    (the cap was hit), then the earliest groups without one, so that `want` groups are picked.
    Sorted by (batch, group). signals: per generated batch, [groups] bool."""
    order = [(b, g) for b, sig in enumerate(signals) for g in range(len(sig))]
    good = [bg for bg in order if signals[bg[0]][bg[1]]]
    bad = [bg for bg in order if not signals[bg[0]][bg[1]]]
    picks = (good + bad)[:want]
    if len(picks) < want:
        raise ValueError(f"pick_groups: {len(order)} groups generated, {want} wanted")
    return sorted(picks)


def concat_batches(parts: list[Batch], pad: int) -> Batch:
    """One Batch of the parts' groups, in order (`concat_rollouts` for the rollouts)."""
    if len(parts) == 1:
        return parts[0]
    episodes = None if parts[0].episodes is None else [e for p in parts for e in p.episodes]
    return Batch([it for p in parts for it in p.items], concat_rollouts([p.rollout for p in parts], pad),
                 [t for p in parts for t in p.texts], {k: torch.cat([p.scores[k] for p in parts]) for k in parts[0].scores},
                 torch.cat([p.rewards for p in parts]), episodes)


