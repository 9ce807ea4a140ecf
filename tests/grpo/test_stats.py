"""Step metrics that read the rollout: a proxy reward's pair accuracy against the verifier."""

from __future__ import annotations

import math

import pytest
import torch

from grpolab.report.schema import describe
from grpolab.algo.metrics import pair_accuracy

NAN = math.nan


def test_pair_accuracy_by_hand():
    # group 0: correct rows 0, 1; wrong rows 2, 3 -> pairs (0,2) (0,3) (1,2) (1,3)
    # group 1: all wrong -> no pair; group 2: correct 0, wrong 1 (tie) and 2 (abstained: left out)
    scores = torch.tensor([0.9, 0.1, 0.5, 0.0, 1.0, 2.0, 3.0, 4.0, 0.3, 0.3, 9.0, NAN])
    correct = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, NAN, 0.0])
    # group 0: 0.9>0.5 ✓, 0.9>0.0 ✓, 0.1<0.5 ✗, 0.1>0.0 ✓ -> 3 of 4; group 2: (8, 9) tie -> 1/2
    assert pair_accuracy(scores, correct, 4) == pytest.approx((3 + 0.5) / 5)  # float32 sums


def test_pair_accuracy_is_nan_without_a_mixed_group_and_1_for_the_gold_itself():
    correct = torch.tensor([1.0, 1.0, 0.0, 0.0])
    assert math.isnan(pair_accuracy(torch.rand(4), correct, 2))  # each group all right or all wrong
    mixed = torch.tensor([1.0, 0.0, 0.0, 1.0])
    assert pair_accuracy(mixed, mixed, 2) == 1.0 and pair_accuracy(-mixed, mixed, 2) == 0.0


def test_pair_accuracy_key_is_described_and_optional():
    spec = describe("pair_acc/accuracy_rm")
    assert spec is not None and spec.unit == "fraction" and "accuracy_rm" in spec.description


def test_the_report_plots_the_pair_accuracy_of_each_proxy():
    from grpolab.report.html import render_plots

    rows = [{"step": i, "reward/mean": 0.1 * i, "reward/rm/mean": 0.2 * i, "accuracy": 0.3, "pair_acc/rm": 0.5 + 0.1 * i}
            for i in range(3)]
    html = render_plots(rows)
    assert "<b>pair_acc/rm</b>" in html  # its figure, captioned by the key
    assert "pair_acc/rm" not in render_plots([{k: v for k, v in r.items() if k != "pair_acc/rm"}
                                                               for r in rows])
