"""rewards/tool_use.py: the share of an episode's tool calls that worked."""

from __future__ import annotations

import pytest

from grpolab.rewards.registry import build_reward
from grpolab.rewards.tool_use import ToolUse


def test_the_share_of_calls_that_worked_and_no_call_for_an_episode_without_calls():
    rows = [{"tool_calls": 2, "tool_errors": 0}, {"tool_calls": 4, "tool_errors": 1}, {"tool_calls": 0, "tool_errors": 0}]
    assert ToolUse()(["p"] * 3, ["c"] * 3, rows) == [1.0, 0.75, 0.0]
    assert build_reward("tool_use", no_call=-0.5)(["p"] * 3, ["c"] * 3, rows) == [1.0, 0.75, -0.5]


def test_rows_that_are_not_episodes_are_named():
    with pytest.raises(ValueError, match="row 1 is not an agent episode"):
        ToolUse()(["p"] * 2, ["c"] * 2, [{"tool_calls": 1, "tool_errors": 0}, {"answer": "3"}])
