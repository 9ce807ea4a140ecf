"""An agent setup by name: which environment, which tools, what limits. `AgentSpec` is plain data
(picklable: it travels to rollout workers); `AgentSpec.build()` loads what it names into an `Agent`.

    spec = AgentSpec(environment="grpolab.agents.builtin:CalculatorTask", environment_kwargs={"digits": 3},
                     tools=("grpolab.agents.builtin:calculator",), max_turns=3, max_episode_tokens=512,
                     max_turn_tokens=64)
    with spec.build() as agent:
        driver = EpisodeDriver(tokenizer, generate, **agent.driver_kwargs())

A run is an agent run when it names an environment or tools (`AgentSpec.active`). Without an
environment, each item's own messages (or prompt) open the episode and tools answer the calls; an
episode then ends at the first turn without a tool call, its reward left to the reward functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from grpolab.agents.envworkers import EnvPool
from grpolab.agents.episode import Episode, scoring_inputs
from grpolab.agents.protocol import Environment, load_environment
from grpolab.agents.tools import ToolBox, load_tools


@dataclass(frozen=True)
class AgentSpec:
    """What an episode runs with, by name (the config's `environment:` and `rollout.*` agent fields)."""

    environment: str = ""
    """'pkg.mod:Class' of the environment (protocol.Environment); empty: the items' own messages."""
    environment_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment's constructor."""
    tools: tuple[str, ...] = ()
    """'pkg.mod:fn' of each tool the policy may call."""
    max_turns: int = 1
    """Policy turns per episode; an episode still going after them is cut (truncated)."""
    max_episode_tokens: int = 1024
    """Prompt, policy turns and environment replies together; an episode that reaches it is cut."""
    max_turn_tokens: int | None = None
    """Longest policy turn in tokens (None: what the episode has left)."""
    tool_timeout_s: float | None = None
    """Time limit of every tool call in seconds (None: each tool's own `timeout_s`, else 10 s)."""
    env_workers: int = 0
    """Ray actors that run the environments (agents/envworkers.py); 0: in this process."""
    env_timeout_s: float = 60.0
    """With env_workers: time limit of every environment call (reset, step) in seconds."""
    env_worker_threads: int = 32
    """With env_workers: environment calls one actor runs at once (a call's time limit includes its wait
    for a free thread)."""

    @classmethod
    def from_config(cls, cfg) -> "AgentSpec":
        """The spec of a Config: `environment:` and rollout.tools / max_turns / max_episode_tokens /
        tool_timeout_s / env_workers / env_timeout_s / env_worker_threads; a policy turn is at most
        rollout.max_new_tokens tokens."""
        r, env = cfg.rollout, cfg.environment
        return cls(env.name, dict(env.kwargs), tuple(r.tools), r.max_turns, r.max_episode_tokens, r.max_new_tokens,
                   r.tool_timeout_s or None, r.env_workers, r.env_timeout_s, r.env_worker_threads)

    @property
    def active(self) -> bool:
        """True when episodes are needed: an environment or tools are named."""
        return bool(self.environment or self.tools)

    @property
    def environment_label(self) -> str:
        """The environment's class name (for metrics and messages), or "environment" without one."""
        return self.environment.rpartition(":")[2] or "environment"

    def build(self) -> "Agent":
        """Loads the environment class and the tools (ConfigError naming the spec when one is wrong).
        With env_workers, the environments are made on Ray actors (an EnvPool, started at the first
        episode); the class is still checked here."""
        make = load_environment(self.environment, self.environment_kwargs) if self.environment else None
        if make is not None and self.env_workers:
            make = EnvPool(self.environment, self.environment_kwargs, self.env_workers, self.env_timeout_s,
                           self.env_worker_threads)
        tools = load_tools(self.tools, self.tool_timeout_s) if self.tools else None
        return Agent(self, make, tools)


@dataclass
class Agent:
    """An AgentSpec, loaded: the environment factory (one fresh environment per episode; an EnvPool
    with env_workers) and the ToolBox (its worker process runs the tool calls). A context manager;
    `close()` stops the tool worker and the env workers."""

    spec: AgentSpec
    make_environment: Callable[[], Environment] | None
    tools: ToolBox | None

    def driver_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `agents.driver.EpisodeDriver` (and `rollout.multiturn.generate_episodes`)
        beside the tokenizer and the model."""
        s = self.spec
        return {"make_environment": self.make_environment, "tools": self.tools, "max_turns": s.max_turns,
                "max_episode_tokens": s.max_episode_tokens, "max_turn_tokens": s.max_turn_tokens}

    def close(self) -> None:
        if self.tools is not None:
            self.tools.close()
        if isinstance(self.make_environment, EnvPool):
            self.make_environment.close()

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def episode_item(item: Any) -> dict[str, Any]:
    """The item an episode starts from: the data row's fields (PromptItem.meta), and the prompt's
    chat messages when the source has them, else its text as "prompt" (they open the episode when
    there is no environment)."""
    out = dict(item.meta)
    if getattr(item, "messages", None) is not None:
        out.setdefault("messages", [dict(m) for m in item.messages])
    elif getattr(item, "prompt", ""):
        out.setdefault("prompt", item.prompt)
    return out


def probe_meta(item: Any, max_new_tokens: int | None = None) -> dict[str, Any]:
    """The metadata of an episode of `item` (a PromptItem) with no turn yet, as start-up probes of reward
    functions score agent runs (rewards.base.probe_reward): the item's fields, what
    `episode.scoring_inputs` adds with the opening as the transcript (the item's messages, or its
    prompt as a user message), and max_new_tokens (rollout.max_new_tokens) as training gives every row."""
    row = episode_item(item)
    opening = row.get("messages") or ([{"role": "user", "content": row["prompt"]}] if "prompt" in row else [])
    _, _, (meta,) = scoring_inputs([Episode(prompt_ids=[], messages=[dict(m) for m in opening])], lambda ids: "")
    limit = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
    return {**item.meta, "truncated": False, **limit, **meta}
