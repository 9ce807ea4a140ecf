"""Token sampling: the inverse-CDF draw, temperature, top-k / top-p filtering."""

import math

import pytest
import torch

from grpolab.rollout.sampling import draw_categorical, filter_logits, greedy_tokens, sample_tokens


def _frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


def _assert_frequencies_match(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    """Each index's frequency is within 5 binomial standard deviations of its probability (a
    sampler that is off by a bin, or ignores the weights, misses by hundreds of them)."""
    n = tokens.numel()
    freq = _frequencies(tokens, probs.numel())
    sd = (probs * (1 - probs) / n).sqrt()
    excess = (freq - probs).abs() - 5 * sd
    assert (excess <= 0).all(), f"frequencies {freq.tolist()} vs probabilities {probs.tolist()}"


def test_draw_categorical_follows_the_row_weights_unnormalized():
    weights = torch.tensor([0.5, 0.0, 2.0, 1.0, 0.0, 0.5])  # sums to 4: not normalized
    n = 200_000
    g = torch.Generator().manual_seed(0)
    tokens = draw_categorical(weights.expand(n, -1), g)
    assert tokens.dtype == torch.int64 and tokens.shape == (n,)
    probs = (weights / weights.sum()).double()
    _assert_frequencies_match(tokens, probs)
    assert not torch.isin(tokens, torch.tensor([1, 4])).any()  # zero weight: never drawn


def test_draw_categorical_rows_are_independent_distributions():
    probs = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        torch.testing.assert_close(draw_categorical(probs, g), torch.tensor([0, 2, 1]))


def test_draw_categorical_reaches_the_last_index_of_a_long_row():
    # all the mass on the last of 50 000 indices (plus 1e-12 elsewhere in one row)
    probs = torch.zeros(4, 50_000, dtype=torch.float64)
    probs[:, -1] = 1.0
    probs[1, 7] = 1e-12
    g = torch.Generator().manual_seed(2)
    torch.testing.assert_close(draw_categorical(probs, g), torch.full((4,), 49_999))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_draw_categorical_rejects_non_finite_rows(bad):
    probs = torch.tensor([[0.5, 0.5], [bad, 0.5]])
    with pytest.raises(ValueError, match="not finite"):
        draw_categorical(probs)
    with pytest.raises(ValueError, match="not finite"):
        draw_categorical(torch.zeros(1, 3))


def test_sample_tokens_same_generator_seed_same_tokens():
    logits = torch.randn(8, 40, generator=torch.Generator().manual_seed(3))
    a = sample_tokens(logits, 0.7, generator=torch.Generator().manual_seed(4))
    b = sample_tokens(logits, 0.7, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(a, b)


def test_sample_tokens_follows_the_temperature_scaled_softmax_and_returns_its_log_prob():
    logits = torch.tensor([2.0, 0.0, -1.0, 1.0])
    temperature = 0.8
    n = 100_000
    tokens, logp = sample_tokens(logits.expand(n, -1), temperature, generator=torch.Generator().manual_seed(5))
    probs = torch.softmax(logits.double() / temperature, -1)
    _assert_frequencies_match(tokens, probs)
    torch.testing.assert_close(logp, probs.log().float()[tokens])


def test_top_k_keeps_the_k_most_likely_and_logp_stays_unfiltered():
    logits = torch.tensor([0.1, 3.0, 2.0, -1.0, 2.5])
    n = 50_000
    tokens, logp = sample_tokens(logits.expand(n, -1), 1.0, top_k=2, generator=torch.Generator().manual_seed(6))
    assert set(tokens.unique().tolist()) == {1, 4}
    kept = torch.softmax(torch.tensor([3.0, 2.5], dtype=torch.float64), -1)
    _assert_frequencies_match(torch.where(tokens == 1, 0, 1), kept)
    torch.testing.assert_close(logp, torch.log_softmax(logits, -1)[tokens])


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    kept = filter_logits(logits[None], top_p=0.75)[0]
    assert torch.isfinite(kept).tolist() == [True, True, False, False]  # 0.5 < 0.75 <= 0.8
    kept = filter_logits(logits[None], top_p=0.5)[0]
    assert torch.isfinite(kept).tolist() == [True, False, False, False]
    tokens, _ = sample_tokens(logits.expand(40_000, -1), 1.0, top_p=0.75, generator=torch.Generator().manual_seed(7))
    _assert_frequencies_match(tokens, torch.tensor([0.625, 0.375, 0.0, 0.0], dtype=torch.float64))


def test_greedy_tokens_is_the_argmax_with_its_log_prob():
    logits = torch.tensor([[0.0, 1.0, 3.0], [5.0, 1.0, 0.0]])
    tokens, logp = greedy_tokens(logits)
    torch.testing.assert_close(tokens, torch.tensor([2, 0]))
    torch.testing.assert_close(logp, torch.log_softmax(logits, -1)[[0, 1], [2, 0]])
    assert math.isclose(float(logp[1]), float(torch.log_softmax(logits[1], -1)[0]))
