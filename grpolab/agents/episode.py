"""The token-level record of one agent episode, and a batch of episodes as the trainer's tensors.

An episode's ids are its prompt ids, then segments: policy turns (the sampled ids as sampled, with
the sampler's log-prob of each) and environment turns (template deltas, delta.py). Only policy
tokens are trained: `policy_mask` is True exactly on them. With one policy turn and no environment
turn after it, `to_tensors` gives today's Rollout layout (batch.py, rollout/hf.py):

    row = [left padding | prompt (Lp columns) | body = the segments (Lb columns) | right padding]
    attention_mask: True on prompt and body tokens; policy_mask == Rollout.loss_mask (the completion
    through its EOS); sampler_logp == Rollout.sampler_logp (0 off the mask); pad after the body.

The trainer's loss mask is then `policy_mask` (& not truncated, where truncated episodes are masked).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

import torch

from grpolab.batch import Rollout

Message = dict[str, Any]


@dataclass(frozen=True)
class Segment:
    """A run of ids from one source. policy: sampled by the policy (trained); else environment text
    (context only). logps: the sampler's log-prob of each id [len(ids)] for a policy segment, None else."""

    ids: tuple[int, ...]
    policy: bool
    logps: tuple[float, ...] | None = None


@dataclass
class Episode:
    """One episode, as the driver (driver.py) records it turn by turn.

    prompt_ids: [Lp_i] the opening messages rendered with the generation prompt. segments: policy
    and environment turns in order. messages: the text transcript (opening messages, assistant turns
    as decoded for the environment, environment/tool messages); for logs and rewards, never training.
    turns: policy turns. tool_calls / tool_errors: calls parsed, and failed calls by kind
    (tools.ERROR_KINDS). rewards: (policy turn index from 0, reward) for each step that gave one.
    done: the environment (or, tools only, a turn without a tool call) ended it. truncated: it was
    cut (stop_reason "max_turns", "max_turn_tokens" or "max_episode_tokens"); stop_reason "env_error":
    the environment raised (env_error; neither done nor truncated); else stop_reason "done".
    """

    prompt_ids: list[int]
    segments: list[Segment] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: Counter = field(default_factory=Counter)
    rewards: list[tuple[int, float]] = field(default_factory=list)
    done: bool = False
    truncated: bool = False
    stop_reason: str = ""
    env_error: str | None = None
    """What the environment raised (stop_reason "env_error"; the episode ends there), else None."""
    weight_version: int | None = None
    """The weight version that sampled its policy turns; None = its EpisodeBatch's."""

    def add_policy(self, ids: Sequence[int], logps: Sequence[float]) -> None:
        """Appends a policy turn: its sampled ids [n] and their sampler log-probs [n]."""
        if len(ids) != len(logps):
            raise ValueError(f"Episode.add_policy: {len(ids)} ids but {len(logps)} log-probs")
        self.segments.append(Segment(tuple(int(i) for i in ids), True, tuple(float(x) for x in logps)))
        self.turns += 1

    def add_env(self, ids: Sequence[int]) -> None:
        """Appends an environment turn's ids (a template delta)."""
        self.segments.append(Segment(tuple(int(i) for i in ids), False))

    def finish(self, stop_reason: str, truncated: bool) -> "Episode":
        """Marks the end: why, and whether it was cut (then not done). Returns the episode."""
        self.stop_reason, self.truncated = stop_reason, truncated
        self.done = not truncated and stop_reason != "env_error"
        return self

    @property
    def body_ids(self) -> list[int]:
        """[Lb_i]: every id after the prompt."""
        return [i for s in self.segments for i in s.ids]

    @property
    def ids(self) -> list[int]:
        """[Lp_i + Lb_i]: the whole episode."""
        return list(self.prompt_ids) + self.body_ids

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + sum(len(s.ids) for s in self.segments)

    @property
    def policy_mask(self) -> list[bool]:
        """[Lb_i]: True where the policy sampled the token."""
        return [s.policy for s in self.segments for _ in s.ids]

    @property
    def sampler_logp(self) -> list[float]:
        """[Lb_i]: the sampler's log-probs on policy tokens, 0.0 elsewhere."""
        return [x for s in self.segments for x in (s.logps if s.policy else (0.0,) * len(s.ids))]

    @property
    def turn_index(self) -> list[int]:
        """[Lb_i]: the policy turn (from 0) of each policy token; -1 on environment tokens."""
        out, turn = [], 0
        for s in self.segments:
            out += [turn if s.policy else -1] * len(s.ids)
            turn += s.policy
        return out

    @property
    def reward(self) -> float | None:
        """The sum of the step rewards, None when no step gave one."""
        return sum(r for _, r in self.rewards) if self.rewards else None


class EpisodeTensors(NamedTuple):
    """A batch of N episodes in the Rollout layout (module docstring). T = Lp + Lb."""

    input_ids: torch.Tensor
    """[N, T] int64: left-padded prompt, body, right padding (pad_id)."""
    attention_mask: torch.Tensor
    """[N, T] bool: True on prompt and body tokens."""
    prompt_len: int
    """Lp: the longest prompt; the body starts at column Lp in every row."""
    policy_mask: torch.Tensor
    """[N, Lb] bool: True = the policy sampled this body token (trained); False = environment or padding."""
    sampler_logp: torch.Tensor
    """[N, Lb] float32: the sampler's log-probs on policy tokens, 0 elsewhere."""
    turn_index: torch.Tensor
    """[N, Lb] int64: the policy turn of each policy token, -1 elsewhere (environment, padding)."""
    truncated: torch.Tensor
    """[N] bool: the episode was cut (Episode.truncated)."""


def to_tensors(episodes: Sequence[Episode], pad_id: int) -> EpisodeTensors:
    """The episodes as tensors: prompts left-padded to Lp = the longest prompt, bodies right-padded to
    Lb = the longest body (both with `pad_id`). Shapes and meanings: EpisodeTensors."""
    if not episodes:
        raise ValueError("to_tensors: no episodes")
    n = len(episodes)
    lp = max(len(e.prompt_ids) for e in episodes)
    lb = max(len(e.body_ids) for e in episodes)
    input_ids = torch.full((n, lp + lb), pad_id, dtype=torch.long)
    attention = torch.zeros((n, lp + lb), dtype=torch.bool)
    policy = torch.zeros((n, lb), dtype=torch.bool)
    logp = torch.zeros((n, lb), dtype=torch.float32)
    turn = torch.full((n, lb), -1, dtype=torch.long)
    for row, e in enumerate(episodes):
        p, body = len(e.prompt_ids), e.body_ids
        input_ids[row, lp - p : lp] = torch.tensor(e.prompt_ids, dtype=torch.long)
        input_ids[row, lp : lp + len(body)] = torch.tensor(body, dtype=torch.long)
        attention[row, lp - p : lp + len(body)] = True
        policy[row, : len(body)] = torch.tensor(e.policy_mask, dtype=torch.bool)
        logp[row, : len(body)] = torch.tensor(e.sampler_logp, dtype=torch.float32)
        turn[row, : len(body)] = torch.tensor(e.turn_index, dtype=torch.long)
    truncated = torch.tensor([e.truncated for e in episodes], dtype=torch.bool)
    return EpisodeTensors(input_ids, attention, lp, policy, logp, turn, truncated)


class EpisodeCounters(NamedTuple):
    """One episode's counts, for logs and stats."""

    turns: int
    """Policy turns."""
    tool_calls: int
    tool_errors: int
    """Failed tool calls, all kinds together (Episode.tool_errors has them by kind)."""
    policy_tokens: int
    env_tokens: int
    """Environment/tool delta ids (template text included)."""
    stop_reason: str
    truncated: bool


def counters_of(e: Episode) -> EpisodeCounters:
    """The episode's counts."""
    policy = sum(len(s.ids) for s in e.segments if s.policy)
    return EpisodeCounters(e.turns, e.tool_calls, sum(e.tool_errors.values()), policy, len(e.body_ids) - policy,
                           e.stop_reason, e.truncated)


@dataclass
class EpisodeBatch:
    """N = P × G episodes, grouped by item (rows g·G .. g·G+G-1 are item g's), and how they were made.

    stats: the engine's counters for the call. The HF engine's: "forwards" (model calls), "rounds"
    (batched turns), "fed_tokens" (ids fed, padding included), "fed_real_tokens" (ids fed, padding
    excluded), "parked_tokens" (token-columns of KV copied to park rows between turns). The vLLM
    engine's: "rounds", "requests", "sent_tokens", "sampled_tokens" (rollout.vllm_engine.VLLMTurnSampler).
    """

    episodes: list[Episode]
    group_size: int
    pad_id: int
    weight_version: int = 0
    stats: dict[str, int] = field(default_factory=dict)

    def tensors(self) -> EpisodeTensors:
        """The trainer's layout (agents.episode.to_tensors): left-padded prompts, right-padded bodies."""
        return to_tensors(self.episodes, self.pad_id)

    def rollout(self) -> Rollout:
        """The episodes as a Rollout: completion = body (policy and environment ids), loss_mask =
        policy_mask (environment ids are context, never trained), sampler_logp on policy ids (0
        elsewhere), truncated = Episode.truncated, versions per row when episodes were sampled by
        different weight versions (Episode.weight_version). For one-turn episodes without an environment this is
        exactly HFEngine's Rollout. The environment's rewards are not in it (see `env_rewards`)."""
        t = self.tensors()
        own = [self.weight_version if e.weight_version is None else e.weight_version for e in self.episodes]
        versions = None if set(own) == {self.weight_version} else \
            torch.tensor(own, dtype=torch.long).unsqueeze(-1).expand(tuple(t.policy_mask.shape)).contiguous()
        return Rollout(input_ids=t.input_ids, attention_mask=t.attention_mask, prompt_len=t.prompt_len,
                       loss_mask=t.policy_mask, truncated=t.truncated, group_size=self.group_size,
                       sampler_logp=t.sampler_logp, weight_version=min(own), versions=versions)

    @property
    def counters(self) -> list[EpisodeCounters]:
        return [counters_of(e) for e in self.episodes]

    def env_rewards(self) -> torch.Tensor:
        """[N] float32: each episode's summed step rewards (Episode.reward), NaN where no step gave one."""
        return torch.tensor([float("nan") if e.reward is None else e.reward for e in self.episodes],
                            dtype=torch.float32)


def env_reward(e: Episode) -> float:
    """The environment's reward of an episode: the sum of its step rewards, 0.0 when no step gave one
    (e.g. an episode cut before the environment's end)."""
    return e.reward if e.reward is not None else 0.0


def last_reply(e: Episode) -> str:
    """The episode's last assistant message ("" when it has none)."""
    return next((m["content"] for m in reversed(e.messages) if m.get("role") == "assistant"), "")


def scoring_inputs(episodes: Sequence[Episode], decode) -> tuple[list[str], list[str], list[dict[str, Any]]]:
    """What reward functions get per episode, in training and held-out evaluation alike: (prompts [N]:
    each opening as the policy saw it, completions [N]: each last assistant message, metadata [N]: per
    episode "messages" (the transcript), "env_reward" (`env_reward`), "turns", "tool_calls",
    "tool_errors" (failed calls, all kinds), "stop_reason", "completion_tokens" (policy tokens)).
    decode: ids -> text (the tokenizer's, special tokens kept)."""
    prompts, texts, metas = [], [], []
    for e in episodes:
        c = counters_of(e)
        prompts.append(decode(e.prompt_ids))
        texts.append(last_reply(e))
        metas.append({"messages": [dict(m) for m in e.messages], "env_reward": env_reward(e), "turns": c.turns,
                      "tool_calls": c.tool_calls, "tool_errors": c.tool_errors, "stop_reason": c.stop_reason,
                      "completion_tokens": c.policy_tokens})
    return prompts, texts, metas


ENVIRONMENT_REWARD = "environment"


class EnvironmentReward:
    """The environment's reward of each episode, read from metadata["env_reward"] (None: abstain).
    A verifier: the step's `accuracy` counts it."""

    name = ENVIRONMENT_REWARD
    verifier = True

    def __call__(self, prompts: Sequence[str], completions: Sequence[str],
                 metadata: Sequence[dict[str, Any]]) -> list[float | None]:
        return [m.get("env_reward") for m in metadata]
