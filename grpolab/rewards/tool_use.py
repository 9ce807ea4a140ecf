"""`tool_use`: a shaping reward for agent episodes that rewards tool calls that work.

Per episode: the share of its tool calls that worked, (tool_calls − tool_errors) / tool_calls, read
from the metadata the GRPO loop gives an episode (`tool_calls`, `tool_errors`: a malformed call, an
unknown tool, bad arguments, a tool that raised or ran out of time); `no_call` (default 0.0) for an
episode without any call. A task reward judges whether the answer is right; this one teaches a
model that rarely calls a tool (or calls it badly) to call it well, e.g.
`rewards: [{name: reasoning_gym, weight: 1.0}, {name: tool_use, weight: 0.2}]`.
Rows without these keys are not episodes: a ValueError naming the reward says so.
"""

from __future__ import annotations

from typing import Any, Sequence


class ToolUse:
    """The share of an episode's tool calls that worked; `no_call` without calls."""

    name = "tool_use"
    verifier = False

    def __init__(self, no_call: float = 0.0):
        self.no_call = float(no_call)

    def __call__(self, prompts: Sequence[str], completions: Sequence[str],
                 metadata: Sequence[dict[str, Any]]) -> list[float | None]:
        out: list[float | None] = []
        for i, row in enumerate(metadata):
            if "tool_calls" not in row or "tool_errors" not in row:
                raise ValueError(f"reward {self.name!r}: row {i} is not an agent episode (no tool_calls / "
                                 "tool_errors): it needs rollout.tools or an environment")
            calls, errors = int(row["tool_calls"]), int(row["tool_errors"])
            out.append(self.no_call if calls == 0 else (calls - errors) / calls)
        return out
