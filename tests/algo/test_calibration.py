"""Logistic calibration on hand-made scores: it recovers a known (a, b), and its probabilities order like the scores."""

import torch

from grpolab.algo.calibration import calibrated, fit_logistic


def test_recovers_the_generating_logistic():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(20000, generator=g) * 3
    y = (torch.rand(20000, generator=g) < torch.sigmoid(2.0 * s - 1.0)).float()
    torch.testing.assert_close(fit_logistic(s, y), torch.tensor([2.0, -1.0]), atol=0.1, rtol=0)  # sampling noise


def test_separable_scores_give_a_finite_steep_fit_and_monotone_probabilities():
    s = torch.tensor([-3.0, -2.0, -1.0, 1.0, 2.0, 3.0])
    y = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    ab = fit_logistic(s, y)
    assert torch.isfinite(ab).all() and ab[0] > 1.0
    p = calibrated(s, ab)
    assert (p[:3] < 0.1).all() and (p[3:] > 0.9).all() and torch.all(p[1:] > p[:-1])
