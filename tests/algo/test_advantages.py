import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpolab.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    STD_MODES,
    group_normalize,
    group_std,
    leave_one_out,
    make_advantage_fn,
    raw_rewards,
    relu_rewards,
    zero_std_groups,
)


def _seed_group(n_correct, n_wrong, n_format):
    """Seed 004's example: 1024 samples, rewards 1 (correct), -1 (wrong), -2 (format error)."""
    r = [1.0] * n_correct + [-1.0] * n_wrong + [-2.0] * n_format
    assert len(r) == 1024
    return torch.tensor([r], dtype=torch.float64)


def _three_values(adv, counts):
    a, b, _ = counts
    return [round(adv[0, 0].item(), 2), round(adv[0, a].item(), 2), round(adv[0, a + b].item(), 2)]


# Seed 004's table with the population std. The source printed 1.43/-0.45/-1.38 for the middle
# row, which does not follow from its own counts (384/512/128); the computed values are tested.
SEED_TABLE = [
    ((1, 127, 896), [8.41, 2.56, -0.37]),
    ((384, 512, 128), [1.24, -0.56, -1.46]),
    ((896, 127, 1), [0.38, -2.63, -4.14]),
]


@pytest.mark.parametrize("counts,expected", SEED_TABLE)
def test_seed_004_normalization_table_population_std(counts, expected):
    adv = group_normalize(_seed_group(*counts), std="population", eps=0.0)
    assert _three_values(adv, counts) == expected


def test_seed_table_tells_sample_std_apart():
    early = group_normalize(_seed_group(1, 127, 896), std="sample", eps=0.0)
    late = group_normalize(_seed_group(896, 127, 1), std="sample", eps=0.0)
    assert round(early[0, 1].item(), 2) == 2.55  # population gives 2.56
    assert round(late[0, 1023].item(), 2) == -4.13  # population gives -4.14


def test_hand_computed_small_group():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    # mean 0.5, population std 0.5, sample std sqrt(1/3)
    torch.testing.assert_close(group_normalize(r, "population", eps=0.0), torch.tensor([[1.0, -1.0, -1.0, 1.0]]))
    s = math.sqrt(1 / 3)
    torch.testing.assert_close(group_normalize(r, "sample", eps=0.0), torch.tensor([[0.5, -0.5, -0.5, 0.5]]) / s)
    torch.testing.assert_close(group_normalize(r, "none"), torch.tensor([[0.5, -0.5, -0.5, 0.5]]))


def test_equal_rewards_give_zero_not_nan():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [2.0, 0.0, 1.0]])
    for std in ("population", "sample", "none"):
        adv = group_normalize(r, std, eps=0.0)
        assert torch.isfinite(adv).all()
        assert (adv[:2] == 0).all()
    assert zero_std_groups(r).tolist() == [True, True, False]
    assert (leave_one_out(r)[:2] == 0).all()


def test_nan_rewards_abstain():
    # Row 1 abstained: left out of the statistics and given advantage 0.
    r = torch.tensor([[1.0, math.nan, 0.0, 1.0, 0.0]])
    adv = group_normalize(r, "population", eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([[1.0, 0.0, -1.0, 1.0, -1.0]]))
    # A group with a single scored row has no baseline: all zero.
    lone = torch.tensor([[math.nan, 3.0, math.nan]])
    assert (group_normalize(lone, "sample") == 0).all()
    assert (leave_one_out(lone) == 0).all()
    assert zero_std_groups(lone).tolist() == [True]
    assert raw_rewards(r)[0, 1] == 0 and relu_rewards(r)[0, 1] == 0


def test_rloo_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    # baseline of row 0 = mean(0, 0, 1) = 1/3
    torch.testing.assert_close(leave_one_out(r), torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3]]))
    # RLOO = G/(G-1) · (r - mean)
    torch.testing.assert_close(leave_one_out(r), group_normalize(r, "none") * 4 / 3)


def test_relu_and_raw():
    r = torch.tensor([[1.0, -1.0, -2.0, 0.5]])
    torch.testing.assert_close(relu_rewards(r), torch.tensor([[1.0, 0.0, 0.0, 0.5]]))
    torch.testing.assert_close(raw_rewards(r), r)


def test_registry_rejects_unknown():
    with pytest.raises(ValueError, match="advantage must be one of"):
        make_advantage_fn("vtrace")
    with pytest.raises(ValueError, match="std must be one of"):
        group_normalize(torch.zeros(1, 2), std="pop")


def test_group_std_matches_torch():
    r = torch.randn(5, 7, dtype=torch.float64)
    torch.testing.assert_close(group_std(r, "population").squeeze(1), r.std(1, unbiased=False))
    torch.testing.assert_close(group_std(r, "sample").squeeze(1), r.std(1, unbiased=True))


rewards_strategy = st.integers(1, 6).flatmap(
    lambda p: st.integers(1, 8).flatmap(
        lambda g: st.lists(
            st.one_of(st.floats(-100, 100, allow_nan=False), st.just(math.nan)), min_size=p * g, max_size=p * g
        ).map(lambda xs: torch.tensor(xs, dtype=torch.float64).view(p, g))
    )
)


@settings(max_examples=60, deadline=None)
@given(rewards_strategy, st.sampled_from(list(ADVANTAGE_ESTIMATORS)), st.sampled_from(list(STD_MODES)))
def test_property_shape_finite_and_zero_on_nan(r, kind, std):
    adv = make_advantage_fn(kind, std=std)(r)
    assert adv.shape == r.shape
    assert torch.isfinite(adv).all()
    assert (adv[torch.isnan(r)] == 0).all()
    if kind in ("group_norm", "rloo"):
        # centred advantages sum to ~0 over the scored rows of each group
        sums = torch.where(torch.isnan(r), torch.zeros_like(adv), adv).sum(1)
        scale = adv.abs().sum(1).clamp(min=1.0)
        assert (sums.abs() <= 1e-9 * scale * 100).all()
