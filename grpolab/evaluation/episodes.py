"""Held-out evaluation of an agent policy: episodes run with `rollout.multiturn.generate_episodes`,
summarised as solve rates, turn counts and tool-call quality.

    with spec.build() as agent:
        metrics = evaluate_agent(engine, agent, heldout_items)        # greedy
        metrics = evaluate_agent(engine, agent, heldout_items, greedy=False, seed=0)  # sampled
        episodes = run_agent_episodes(engine, agent, heldout_items)  # the episodes themselves
        metrics = episode_metrics(episodes)
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from grpolab.agents.episode import Episode
from grpolab.rollout.multiturn import generate_episodes

MALFORMED_KINDS = ("malformed", "unknown_tool", "bad_arguments")
"""Tool-call failures that are the call's own fault (agents.tools.ERROR_KINDS); "raised" and "timeout"
are calls that were well formed but failed in the tool."""


def evaluate_agent(engine: Any, agent: Any, items: Sequence[Any], *, model: torch.nn.Module | None = None,
                   greedy: bool = True, seed: int = 0, samples_per_item: int = 1,
                   batch_items: int = 64, logits_processor=None) -> dict[str, Any]:
    """The metrics (`episode_metrics`) of the agent's episodes on `items` (`run_agent_episodes`,
    same arguments). Greedy by default; greedy=False samples with a generator seeded by `seed`."""
    return episode_metrics(run_agent_episodes(engine, agent, items, model=model, greedy=greedy, seed=seed,
                                              samples_per_item=samples_per_item, batch_items=batch_items,
                                              logits_processor=logits_processor))


def run_agent_episodes(engine: Any, agent: Any, items: Sequence[Any], *, model: torch.nn.Module | None = None,
                       greedy: bool = True, seed: int = 0, samples_per_item: int = 1,
                       batch_items: int = 64, logits_processor=None) -> list[Episode]:
    """The agent's episodes on `items`, samples_per_item per item, in item order.

    engine: an HFEngine (its tokenizer and sampling settings; rollout.multiturn.generate_episodes);
    model: the policy (default: engine.model). agent: an agents.agent.Agent (environment, tools,
    limits). greedy: argmax turns (samples_per_item is then best left at 1); else each turn is sampled
    at the engine's temperature with torch.Generator().manual_seed(seed), so the result is
    reproducible. batch_items: items per generate_episodes call (bounds the KV caches held at once).
    logits_processor: as generate_episodes' (e.g. to force scripted turns in tests), its episode
    indices counted over the whole evaluation (item i's episodes are i·samples_per_item, ...).
    The model's train/eval mode is kept.
    """
    if not items:
        raise ValueError("run_agent_episodes: no items")
    generator = None if greedy else torch.Generator().manual_seed(seed)
    episodes: list[Episode] = []
    for start in range(0, len(items), batch_items):
        batch = generate_episodes(engine, items[start : start + batch_items], samples_per_item, model=model,
                                  generator=generator, greedy=greedy,
                                  logits_processor=_offset(logits_processor, start * samples_per_item),
                                  **agent.driver_kwargs())
        episodes += batch.episodes
    return episodes


def _offset(processor, offset: int):
    """`processor` called with episode indices shifted by `offset` (None stays None)."""
    if processor is None:
        return None
    return lambda rows, logits: processor([offset + r for r in rows], logits)


def score_episodes(episodes: Sequence[Episode], metas: Sequence[dict[str, Any]], rewards: Sequence[tuple[Any, float]],
                   decode, max_new_tokens: int | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Each episode scored as training scores it (agents.episode.scoring_inputs): its last assistant
    message by every reward of `rewards` ([(RewardFn, weight)]), metas [N]: each episode's item fields
    (the data row's); max_new_tokens: rollout.max_new_tokens, in every row's metadata as in training.
    Returns (scores: name -> [N], NaN = abstained; the weighted sum [N])."""
    from grpolab.agents.episode import scoring_inputs
    from grpolab.rewards.base import combine, score_batch

    prompts, texts, extra = scoring_inputs(episodes, decode)
    limit = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
    rows = [{**m, "truncated": e.truncated, "completion_ids": e.body_ids, **limit, **x}
            for m, e, x in zip(metas, episodes, extra)]
    scores = {fn.name: score_batch(fn, prompts, texts, rows) for fn, _ in rewards}
    return scores, combine(scores, {fn.name: w for fn, w in rewards})


def episode_metrics(episodes: Sequence[Episode], solved: Sequence[bool] | None = None) -> dict[str, Any]:
    """The metrics of a list of episodes (N = len(episodes)):

    - "episodes": N;
    - "reward/mean": the mean over all N episodes of the environment's summed reward (Episode.reward);
      an episode that got no reward (None: cut before the environment scored it, or an environment
      error) counts as 0.0;
    - "solved": the share of episodes whose environment reward is > 0 (the accuracy of a one-answer
      task such as CalculatorTask), or of those `solved` marks [N] (e.g. a verifier's 1.0 when there
      is no environment); "accuracy": the same number;
    - "turns/mean": policy turns per episode; "turns_to_solve/mean": policy turns per solved episode
      (None when none was solved);
    - "tool_calls/count": tool calls parsed, all episodes; "tool_calls/mean": per episode;
      "tool_use/frac": the share of episodes with at least one call;
    - "tool_calls/well_formed": the share of calls that were neither malformed, nor to an unknown
      tool, nor with bad arguments (MALFORMED_KINDS); 1.0 when there were no calls;
    - "tool_errors/<kind>": failed calls of each kind (agents.tools.ERROR_KINDS) that occurred;
    - "truncated/frac": the share of episodes cut by a limit (Episode.truncated);
      "env_error/frac": the share ended by an environment error.
    """
    n = len(episodes)
    if n == 0:
        raise ValueError("episode_metrics: no episodes")
    rewards = [e.reward if e.reward is not None else 0.0 for e in episodes]
    marks = [r > 0 for r in rewards] if solved is None else list(solved)
    if len(marks) != n:
        raise ValueError(f"episode_metrics: {len(marks)} solved marks for {n} episodes")
    won = [e for e, ok in zip(episodes, marks) if ok]
    calls = sum(e.tool_calls for e in episodes)
    errors: dict[str, int] = {}
    for e in episodes:
        for kind, count in e.tool_errors.items():
            errors[kind] = errors.get(kind, 0) + count
    bad = sum(errors.get(k, 0) for k in MALFORMED_KINDS)
    out = {
        "episodes": n,
        "reward/mean": sum(rewards) / n,
        "solved": len(won) / n,
        "accuracy": len(won) / n,
        "turns/mean": sum(e.turns for e in episodes) / n,
        "turns_to_solve/mean": sum(e.turns for e in won) / len(won) if won else None,
        "tool_calls/count": calls,
        "tool_calls/mean": calls / n,
        "tool_use/frac": sum(e.tool_calls > 0 for e in episodes) / n,
        "tool_calls/well_formed": 1.0 - bad / calls if calls else 1.0,
        "truncated/frac": sum(e.truncated for e in episodes) / n,
        "env_error/frac": sum(e.stop_reason == "env_error" for e in episodes) / n,
    }
    out.update({f"tool_errors/{k}": v for k, v in sorted(errors.items())})
    return out
