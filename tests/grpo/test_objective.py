"""grpolab.grpo.objective: SkipEmptyRows leaves the gradient and the recorded log-probs unchanged."""

from __future__ import annotations

import pytest
import torch

from grpolab import config as C
from grpolab.data.arith import ArithTask
from grpolab.data.stream import ArithStream
from grpolab.models.tiny import build_char_tokenizer, build_tiny_model
from grpolab.grpo.objective import Objective, SkipEmptyRows
from grpolab.grpo.setup import build_setup


@pytest.mark.parametrize("shared_prompt", [False, True])
def test_skip_empty_rows_keeps_the_gradient_and_the_logprobs(shared_prompt):
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, seed=0).double()
    cfg = C.from_preset("dapo", ["rollout.prompts_per_step=4", "rollout.group_size=2", "train.minibatch_size=8",
                                 "train.microbatch_size=8", "run.tensorboard=false", "run.progress=false",
                                 f"model.shared_prompt={str(shared_prompt).lower()}", "model.dtype=float32"])
    s = build_setup(cfg, policy=model, tokenizer=tok, prompts=ArithStream(ArithTask(), seed=0))
    assert isinstance(s.optim.objective, SkipEmptyRows)  # loss.filter_zero_std_groups can empty rows
    plain: Objective = s.optim.objective.objective
    items = s.data.prompts.next_batch(4)
    ro = s.data.engine.generate([it.prompt for it in items], 2, generator=torch.Generator().manual_seed(0))
    mask = ro.loss_mask.clone()
    mask[2:6] = False  # two groups dropped as zero-variance
    mask[7] = False  # one truncated completion masked out (its group stays)
    ro = ro.replace(loss_mask=mask, advantages=torch.tensor([1.0, -1.0, 0, 0, 0, 0, 0.5, -0.5]))
    norm = plain.normalizer(ro.loss_mask)
    grads, logps = [], []
    for obj in (plain, s.optim.objective):
        model.zero_grad()
        loss, stats = obj(model, ro, norm)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        logps.append(stats["logp"])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    # the log-probs handed back (Phase B keeps them as old_logp when μ > 1) cover every row:
    # the counted rows' values, 0 for the rows that were not forwarded
    assert logps[1].shape == logps[0].shape
    keep = mask.any(-1)
    torch.testing.assert_close(logps[1][keep], logps[0][keep])
    skipped = torch.tensor([False, False, True, True, True, True, False, not shared_prompt])
    assert torch.equal(logps[1][skipped], torch.zeros_like(logps[1][skipped]))
    assert bool((logps[1][~skipped & keep] != 0).any())


def test_skip_empty_rows_of_an_all_empty_microbatch_gives_a_zero_loss_with_a_graph():
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    cfg = C.from_preset("dapo", ["rollout.prompts_per_step=2", "rollout.group_size=2", "train.minibatch_size=4",
                                 "train.microbatch_size=4", "run.tensorboard=false", "run.progress=false",
                                 "model.dtype=float32"])
    s = build_setup(cfg, policy=model, tokenizer=tok, prompts=ArithStream(ArithTask(), seed=0))
    ro = s.data.engine.generate([it.prompt for it in s.data.prompts.next_batch(2)], 2, generator=torch.Generator().manual_seed(0))
    ro = ro.replace(loss_mask=torch.zeros_like(ro.loss_mask), advantages=torch.ones(4))
    loss, stats = s.optim.objective(model, ro, s.optim.objective.normalizer(ro.loss_mask))
    loss.backward()
    assert float(loss.detach()) == 0.0 and stats["logp"].shape == ro.loss_mask.shape
