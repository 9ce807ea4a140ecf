"""Rollout.select: the rows asked for, trimmed of all-padding columns, as fresh tensors."""

import torch

from grpolab.batch import Rollout


def _rollout():
    # 4 rows, prompt width 3 (row 0 and 1 have one left pad), completions of width 4
    ids = torch.arange(28).view(4, 7)
    am = torch.ones(4, 7, dtype=torch.bool)
    am[[0, 1], 0] = False
    loss = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    am[:, 3:] = loss
    return Rollout(input_ids=ids, attention_mask=am, prompt_len=3, loss_mask=loss,
                   truncated=torch.tensor([False, False, False, True]), group_size=2,
                   old_logp=torch.randn(4, 4), advantages=torch.randn(4))


def test_select_trims_padding_columns_and_keeps_the_rows_values():
    ro = _rollout()
    sub = ro.select(torch.tensor([1, 0]))
    # both rows start with a pad column (dropped) and count at most 3 completion tokens
    assert sub.prompt_len == 2
    torch.testing.assert_close(sub.input_ids, ro.input_ids[[1, 0], 1:6])
    torch.testing.assert_close(sub.loss_mask, ro.loss_mask[[1, 0], :3])
    torch.testing.assert_close(sub.old_logp, ro.old_logp[[1, 0], :3])
    torch.testing.assert_close(sub.advantages, ro.advantages[[1, 0]])
    full = ro.select(torch.tensor([3, 2]))  # no common left pad, one row counts all 4 tokens
    assert full.prompt_len == 3 and full.input_ids.shape == (2, 7)


def test_select_returns_fresh_contiguous_tensors_never_views():
    """A compiled training forward guards on strides and on a view's base: a microbatch that is
    sometimes a view and sometimes not recompiles it (30 s on the bench fixture) mid-run."""
    ro = _rollout()
    for idx in (torch.tensor([1, 0]), torch.tensor([3, 2]), torch.arange(4)):
        sub = ro.select(idx)
        for name in ("input_ids", "attention_mask", "loss_mask", "old_logp", "truncated", "advantages"):
            t = getattr(sub, name)
            assert t._base is None and t.is_contiguous(), (name, idx.tolist())
            assert t.untyped_storage().data_ptr() != getattr(ro, name).untyped_storage().data_ptr()
