"""Reward-model ensemble modes on hand-computed values."""

from __future__ import annotations

import pytest
import torch

from grpolab.algo.ensembles import ENSEMBLES

SCORES = torch.tensor([[1.0, 0.0, 2.0],
                       [3.0, 0.0, -2.0]], dtype=torch.float64)  # K = 2 members, N = 3 completions


@pytest.mark.parametrize("mode,lam,expected", [
    ("mean", 0.0, [2.0, 0.0, 0.0]),
    ("min", 0.0, [1.0, 0.0, -2.0]),
    ("mean_minus_std", 1.0, [1.0, 0.0, -2.0]),   # population std: 1, 0, 2
    ("mean_minus_std", 0.5, [1.5, 0.0, -1.0]),
    ("mean_minus_var", 0.5, [1.5, 0.0, -2.0]),   # variance: 1, 0, 4
])
def test_each_mode_on_hand_computed_scores(mode, lam, expected):
    torch.testing.assert_close(ENSEMBLES[mode](SCORES, lam), torch.tensor(expected, dtype=torch.float64))


def test_members_that_agree_give_their_common_score_in_every_mode():
    same = torch.tensor([[0.3, -1.0]] * 3, dtype=torch.float64)
    for mode, fn in ENSEMBLES.items():
        torch.testing.assert_close(fn(same, 2.0), same[0], msg=mode)


def test_a_disputed_completion_ranks_below_an_agreed_one_with_the_same_mean():
    """The point of the penalty: equal means, the members disagree on the second completion."""
    scores = torch.tensor([[1.0, 3.0], [1.0, -1.0]], dtype=torch.float64)
    for mode in ("min", "mean_minus_std", "mean_minus_var"):
        r = ENSEMBLES[mode](scores, 1.0)
        assert r[0] > r[1], mode
    assert ENSEMBLES["mean"](scores, 1.0)[0] == ENSEMBLES["mean"](scores, 1.0)[1]
