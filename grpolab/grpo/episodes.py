"""Phase A for agent runs: G episodes per item instead of G completions, and what the step needs of them.

An episode's row in the Rollout is its whole token sequence; loss_mask is True on the policy's own
tokens only (environment and tool replies are context: no loss, no KL, never counted), so the rest
of the loop is the completions' one. Here:

- `sample_episodes`: the episodes of a batch of items, on the in-process engine or the rollout
  workers (rollout/multiturn.py, rollout/ray_engine.py), from the step's seeded sampling stream;
- the environment's reward is a reward function like the others (agents.episode.EnvironmentReward,
  weighted by environment.reward_weight);
- what the reward functions get per episode is agents.episode.scoring_inputs' (the last assistant
  message as the completion, the opening as the prompt, the transcript and counts in the metadata);
- `apply_env_errors`: an environment that raised follows train.on_reward_error for its episode
  (raise: the run stops with the environment's message; zero: the episode's environment reward
  is 0; skip_group: the environment abstains on the episode's whole group);
- `episode_rows`: per episode, the counts and the token segments that metrics and samples.jsonl keep.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from grpolab.agents.agent import episode_item
from grpolab.agents.episode import EpisodeBatch, env_reward
from grpolab.rewards.base import RewardError

def sample_episodes(s, items: Sequence[Any], generator, in_flight=None) -> EpisodeBatch:
    """G = rollout.group_size episodes of each item (rows grouped by item), sampled with `generator`:
    by the rollout workers when the engine has them (`submit_episodes`), else in this process."""
    if in_flight is not None:
        return in_flight.result()
    rows = [episode_item(it) for it in items]
    engine, G = s.data.engine, s.cfg.rollout.group_size
    if hasattr(engine, "submit_episodes"):
        return engine.submit_episodes(rows, G, s.data.agent.spec, generator=generator).result()
    from grpolab.rollout.multiturn import generate_episodes

    return generate_episodes(engine, rows, G, generator=generator, **s.data.agent.driver_kwargs())


def apply_env_errors(batch: EpisodeBatch, items: Sequence[Any], metas: list[dict[str, Any]], on_error: str,
                     st) -> None:
    """Applies train.on_reward_error to the episodes whose environment raised (module docstring),
    in `metas` (scoring_inputs'); counts each in st.reward_errors with a console note. RewardError
    naming the environment and the item (of `items`, one per group) for on_error="raise"."""
    G = batch.group_size
    failed = [i for i, e in enumerate(batch.episodes) if e.env_error]
    if not failed:
        return
    if on_error == "raise":
        e = batch.episodes[failed[0]]
        item = getattr(items[failed[0] // G], "meta", items[failed[0] // G])
        raise RewardError(f"environment: {e.env_error} (item {item!r}); "
                          "set train.on_reward_error=zero or skip_group to continue past it")
    for i in failed:
        rows = range(i // G * G, i // G * G + G) if on_error == "skip_group" else [i]
        for r in rows:
            metas[r]["env_reward"] = 0.0 if on_error == "zero" else None
    st.reward_errors += len(failed)
    what = "scored 0" if on_error == "zero" else "abstained on its group"
    st.notes.append(f"environment: {batch.episodes[failed[0]].env_error} ({len(failed)} episode(s); "
                    f"train.on_reward_error={on_error}: {what})")


def episode_rows(batch: EpisodeBatch, decode) -> list[dict[str, Any]]:
    """Per episode: turns, tool_calls, tool_errors, stop_reason, env_reward, policy_tokens,
    env_tokens, solved (the environment's reward is > 0) and segments ([{"source": "prompt" |
    "policy" | "env", "text", "tokens"}], the whole episode in order). decode: as scoring_inputs'."""
    out = []
    for e, c in zip(batch.episodes, batch.counters):
        segments = [{"source": "prompt", "text": decode(e.prompt_ids), "tokens": len(e.prompt_ids)}]
        segments += [{"source": "policy" if s.policy else "env", "text": decode(s.ids), "tokens": len(s.ids)}
                     for s in e.segments]
        reward = env_reward(e)
        out.append({"turns": c.turns, "tool_calls": c.tool_calls, "tool_errors": c.tool_errors,
                    "stop_reason": c.stop_reason, "env_reward": reward, "policy_tokens": c.policy_tokens,
                    "env_tokens": c.env_tokens, "solved": reward is not None and reward > 0,
                    "env_error": e.env_error, "segments": segments})
    return out


def episode_metrics(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The step's `episode/*` metrics over its episodes (episode_rows'): means of turns, tool_calls,
    tool_errors, policy_tokens, env_tokens; solved (share solved), turns_to_solve (mean turns of the
    solved ones; NaN when none), env_errors (count)."""
    n = max(len(rows), 1)
    out = {f"episode/{k}": sum(r[k] for r in rows) / n
           for k in ("turns", "tool_calls", "tool_errors", "policy_tokens", "env_tokens")}
    solved = [r["turns"] for r in rows if r["solved"]]
    out["episode/solved"] = len(solved) / n
    out["episode/turns_to_solve"] = sum(solved) / len(solved) if solved else math.nan
    out["episode/env_errors"] = float(sum(1 for r in rows if r["env_error"]))
    return out
