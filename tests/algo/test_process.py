"""Process-RM math on hand-made tensors: prefix step labels, the weakest-step score, the step BCE."""

import math

import torch

from grpolab.algo.process import generative_step_loss, prefix_step_labels, process_scores, process_step_loss

# prompt "7+5=" as ids 1 2 3 4, answer "12" = 5 6, EOS = 9, pad 0; steps are the completion tokens and EOS
PROMPT = [1, 2, 3, 4]
TARGET = PROMPT + [5, 6, 9]


def _rows(*completions):
    seqs = [PROMPT + c + [9] for c in completions]
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    steps = torch.tensor([[len(PROMPT) <= j < len(s) for j in range(width)] for s in seqs])
    tgt = torch.tensor([(TARGET + [-1] * width)[:width]] * len(seqs))
    return ids, tgt, steps


def test_prefix_labels_right_until_the_first_wrong_step():
    ids, tgt, steps = _rows([5, 6], [5, 7], [8, 6], [5], [5, 6, 6])
    labels = prefix_step_labels(ids, tgt, steps)
    c = len(PROMPT)
    assert labels[0, c:c + 3].tolist() == [True, True, True]  # "12" EOS: every step right
    assert labels[1, c:c + 3].tolist() == [True, False, False]  # "17": the second digit is wrong, EOS too
    assert labels[2, c:c + 3].tolist() == [False, False, False]  # "86": wrong from the first digit on
    assert labels[3, c:c + 2].tolist() == [True, False]  # "1" then EOS where "2" belongs: stops early
    assert labels[4, c:c + 4].tolist() == [True, True, False, False]  # "122": runs on past the answer
    assert not (labels & ~steps).any()  # nothing outside the steps


def test_weakest_step_is_the_sequence_score():
    scores = torch.tensor([[9.0, 2.0, -1.0, 5.0], [0.0, 3.0, 4.0, -7.0], [1.0, 1.0, 1.0, 1.0]])
    steps = torch.tensor([[False, True, True, True], [False, True, True, False], [False, False, False, False]])
    torch.testing.assert_close(process_scores(scores, steps), torch.tensor([-1.0, 3.0, 0.0]))


def test_step_loss_is_the_mean_bce_over_steps():
    scores = torch.tensor([[0.0, 2.0, -1.0], [5.0, 0.0, 0.0]])
    labels = torch.tensor([[False, True, False], [True, False, False]])
    steps = torch.tensor([[False, True, True], [True, False, False]])

    def bce(x, y):
        p = 1 / (1 + math.exp(-x))
        return -(y * math.log(p) + (1 - y) * math.log(1 - p))

    want = torch.tensor([(bce(2.0, 1) + bce(-1.0, 0)) / 2, bce(5.0, 1)])
    torch.testing.assert_close(process_step_loss(scores, labels, steps), want)
    steps_none = torch.zeros_like(steps)
    torch.testing.assert_close(process_step_loss(scores, labels, steps_none), torch.zeros(2))


def test_generative_step_loss_by_hand():
    logp = torch.log(torch.tensor([[0.5, 0.9, 0.2], [0.25, 0.5, 0.5]]))
    labels = torch.tensor([[False, True, False], [True, True, False]])
    steps = torch.tensor([[False, True, True], [True, True, False]])
    want = torch.tensor([(-math.log(0.9) - math.log(1 - 0.2)) / 2, (-math.log(0.25) - math.log(0.5)) / 2])
    torch.testing.assert_close(generative_step_loss(logp, labels, steps), want)
