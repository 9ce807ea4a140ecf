"""The `overlong` reward (rewards/shaping.py): DAPO's soft overlong punishment (eq. 13), against
values computed by hand from TRL's and verl's definitions; what it reads from the metadata."""

from types import SimpleNamespace

import pytest
import torch

from grpolab.errors import ConfigError
from grpolab.rewards.registry import build_reward, reward_names
from grpolab.rewards.shaping import overlong_penalty
from grpolab.grpo.stats import StepStats, score_rollout


def test_trl_soft_overlong_punishment_values():
    # TRL get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4): 0 up to 6 tokens,
    # (6 - L) / 4 in (6, 10], -1 past 10
    got = overlong_penalty(torch.tensor([0, 6, 7, 8, 10, 11, 40]), max_len=10, buffer_len=4, penalty_factor=1.0)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]


def test_verl_overlong_buffer_values():
    # verl's DAPO reward manager, max_resp_len=16, overlong_buffer.len=4, penalty_factor=0.5:
    # min(-(L - 12) / 4 * 0.5, 0)
    got = overlong_penalty(torch.tensor([3, 12, 13, 14, 16]), max_len=16, buffer_len=4, penalty_factor=0.5)
    assert got.tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]


def test_a_zero_buffer_punishes_only_past_the_limit():
    got = overlong_penalty(torch.tensor([9, 10, 11]), max_len=10, buffer_len=0, penalty_factor=2.0)
    assert got.tolist() == [0.0, 0.0, -2.0]


def test_the_builtin_reward_reads_lengths_and_the_limit_from_the_metadata():
    assert "overlong" in reward_names()
    fn = build_reward("overlong", buffer_len=4, penalty_factor=1.0)
    assert fn.name == "overlong" and fn.verifier is False
    meta = [{"completion_tokens": n, "max_new_tokens": 16} for n in (12, 14, 16)] + [{"truncated": False}]
    assert fn(["p"] * 4, ["a"] * 4, meta) == [0.0, -0.5, -1.0, None]  # no length (a probe): abstains
    explicit = build_reward("overlong", buffer_len=2, penalty_factor=0.5, max_len=10)
    assert explicit(["p"], ["a"], [{"completion_tokens": 9}]) == [-0.25]


def test_bad_arguments_name_the_field():
    with pytest.raises(ConfigError, match="kwargs.buffer_len=-1"):
        build_reward("overlong", buffer_len=-1)
    with pytest.raises(ConfigError, match="kwargs.buffer_len=8 must be ≤ kwargs.max_len=4"):
        build_reward("overlong", buffer_len=8, max_len=4)
    with pytest.raises(ConfigError, match="kwargs.penalty_factor"):
        build_reward("overlong", buffer_len=2, penalty_factor=-1.0)
    with pytest.raises(ValueError, match="buffer_len=32 is longer than rollout.max_new_tokens=16"):
        build_reward("overlong", buffer_len=32)(["p"], ["a"], [{"completion_tokens": 3, "max_new_tokens": 16}])


def test_score_rollout_gives_each_row_its_generated_tokens_and_the_limit():
    items = [SimpleNamespace(prompt="1+1=", meta={"answer": "2", "answerable": True})]
    # prompt width 2; completions of 3, 1 and 4 tokens (EOS included) in a width of 4
    am = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    ro = SimpleNamespace(group_size=3, truncated=torch.tensor([False, False, True]), prompt_len=2, attention_mask=am,
                         input_ids=torch.arange(18).view(3, 6))
    seen = []

    def spy(prompts, completions, metadata):
        seen.extend(metadata)
        return [0.0] * len(completions)

    spy.name = "spy"
    overlong = build_reward("overlong", buffer_len=2)
    scores, _ = score_rollout([(spy, 1.0), (overlong, 1.0)], items, ["a", "b", "c"], ro, "raise", StepStats(0),
                              max_new_tokens=4)
    assert [m["completion_tokens"] for m in seen] == [3, 1, 4]
    assert [m["completion_ids"] for m in seen] == [[2, 3, 4], [8], [14, 15, 16, 17]]  # the unpadded completion ids
    assert all(m["max_new_tokens"] == 4 and m["answer"] == "2" for m in seen)
    assert scores["overlong"].tolist() == [-0.5, 0.0, -1.0]
