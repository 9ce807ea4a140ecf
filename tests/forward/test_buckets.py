"""grpolab.forward.buckets: which rows share a chunk of a log-prob pass."""

from __future__ import annotations


import pytest
import torch

from grpolab.forward.buckets import (
    balanced_buckets,
    balanced_partition,
    group_buckets,
    length_buckets,
)

G = 4  # the group size of the `rollout` fixture (tests/forward/conftest.py)


def _tokens(ro, chunk, whole_groups=False):
    """Real tokens a padding-free forward of `chunk` computes (each group's prompt once when grouped)."""
    am = ro.attention_mask[chunk]
    total = int(am.sum())
    if whole_groups:
        total -= (G - 1) * int(am[::G, : ro.prompt_len].sum())
    return total


def test_length_buckets_cover_rows_once_in_length_order(rollout):
    chunks = length_buckets(rollout, 5)
    assert [len(c) for c in chunks] == [5, 5, 2]
    order = torch.cat(chunks)
    assert sorted(order.tolist()) == list(range(rollout.num_sequences))
    lengths = rollout.completion_lengths[order]
    assert bool((lengths[1:] >= lengths[:-1]).all())


def test_group_buckets_cut_whole_groups_in_length_order(rollout):
    chunks = group_buckets(rollout, 2 * G)
    rows = torch.cat(chunks)
    assert sorted(rows.tolist()) == list(range(rollout.num_sequences))
    groups = rows.view(-1, G)
    assert bool((groups == groups[:, :1] + torch.arange(G)).all()) and bool((groups[:, 0] % G == 0).all())
    longest = rollout.completion_lengths[rows].view(-1, G).amax(-1)
    assert bool((longest[1:] >= longest[:-1]).all())
    with pytest.raises(ValueError, match="whole groups"):
        group_buckets(rollout, G + 1)


def test_balanced_partition_fills_each_bin_to_its_size_lowest_total_first():
    # 10 -> bin 0; 9 -> bin 1; 8 -> bin 1 (9 < 10); the 1s -> bin 0 (10, 11), bin 0 is full, the last -> bin 1
    bins = balanced_partition(torch.tensor([1, 10, 1, 8, 9, 1]), [3, 3])
    assert [b.tolist() for b in bins] == [[0, 1, 2], [3, 4, 5]]
    bins = balanced_partition(torch.tensor([5, 5, 5, 5, 5]), [2, 2, 1])
    assert [len(b) for b in bins] == [2, 2, 1]
    with pytest.raises(ValueError, match="do not hold 5 units"):
        balanced_partition(torch.ones(5, dtype=torch.long), [2, 2])


def test_balanced_partition_evens_random_costs_better_than_a_sorted_split():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        cost = torch.randint(20, 140, (128,), generator=g)
        bins = balanced_partition(cost, [32] * 4)
        assert sorted(torch.cat(bins).tolist()) == list(range(128))
        totals = torch.stack([cost[b].sum() for b in bins])
        by_length = torch.stack([c.sum() for c in cost.sort().values.split(32)])
        assert int(totals.max() - totals.min()) <= int(cost.max())  # within one unit's cost
        assert int(totals.max() - totals.min()) < int(by_length.max() - by_length.min())


@pytest.fixture(scope="module")
def eight_groups(tok):
    """8 groups of G rows from a real rollout: prompts of 2-6 characters, completions of many lengths."""
    from grpolab.models.tiny import build_tiny_model
    from grpolab.rollout.hf import HFEngine

    sampler = build_tiny_model(tok, hidden_size=64, num_layers=2, num_heads=4, seed=1)
    prompts = ["1+1=", "12+34=", "7=", "5+5=", "123+4=", "9=", "44+4=", "3+21="]
    return HFEngine(tok, max_new_tokens=12).generate_with(sampler, prompts, G, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("whole_groups", [False, True], ids=["rows", "groups"])
def test_balanced_buckets_even_out_the_real_tokens_of_same_size_chunks(eight_groups, whole_groups):
    rollout = eight_groups
    size = 2 * G  # 4 chunks of 8 rows
    chunks = balanced_buckets(rollout, size, whole_groups=whole_groups)
    assert [len(c) for c in chunks] == [len(c) for c in length_buckets(rollout, size)]
    rows = torch.cat(chunks)
    assert sorted(rows.tolist()) == list(range(rollout.num_sequences))
    tokens = [_tokens(rollout, c, whole_groups) for c in chunks]
    if whole_groups:
        groups = rows.view(-1, G)
        assert bool((groups == groups[:, :1] + torch.arange(G)).all()) and bool((groups[:, 0] % G == 0).all())
        sorted_chunks = group_buckets(rollout, size)
    else:
        assert all(bool((c[1:] > c[:-1]).all()) for c in chunks)  # index order within a chunk
        sorted_chunks = length_buckets(rollout, size)
    by_length = [_tokens(rollout, c, whole_groups) for c in sorted_chunks]
    assert max(tokens) - min(tokens) < max(by_length) - min(by_length)
    assert sum(tokens) == sum(by_length)


def test_layouts_balance_padding_free_chunks_only(rollout):
    """Each layout's chunking: padded rows by length, whole groups by length, padding-free by tokens."""
    from grpolab.forward import layout_for

    assert layout_for(False, False).chunks is length_buckets
    assert layout_for(False, True).chunks is group_buckets
    assert layout_for(True, False).chunks is balanced_buckets
    both = layout_for(True, True).chunks
    assert both.func is balanced_buckets and both.keywords == {"whole_groups": True}
    for padding_free in (False, True):
        assert layout_for(padding_free, True).whole_groups and not layout_for(padding_free, False).whole_groups
