"""The grouped log-prob forward (model.shared_prompt, alone or with model.padding_free): each group's
prompt once, same log-probs and gradients as the padded forward."""

from __future__ import annotations

import copy

import pytest
import torch

from grpolab.forward import batched_logprobs, completion_logprobs, shared_prompt
from grpolab.forward.attention import FAST_CPU_ATTENTION
from grpolab.models.tiny import build_tiny_model

G = 4  # the group size of the `rollout` fixture (tests/forward/conftest.py)


def _logp_grad(model, ro, group_size, dtype=None, weights=None, entropy_grad=False, padding_free=False):
    model.zero_grad(set_to_none=True)
    logp, ent = completion_logprobs(model, ro.input_ids, ro.attention_mask, ro.prompt_len, 0.9, with_entropy=True,
                                    compute_dtype=dtype, entropy_grad=entropy_grad, group_size=group_size,
                                    padding_free=padding_free)
    w = weights if weights is not None else torch.ones_like(logp)
    loss = (logp * w * ro.loss_mask).sum() + ((ent * ro.loss_mask).sum() if entropy_grad else 0)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return logp.detach(), ent.detach(), grads


@pytest.mark.parametrize("padding_free", [False, True], ids=["grouped", "packed-groups"])
def test_grouped_forward_matches_the_padded_forward_in_fp32(model, rollout, padding_free):
    m = copy.deepcopy(model).train()
    weights = torch.randn(rollout.loss_mask.shape, generator=torch.Generator().manual_seed(2))
    want_lp, want_ent, want_g = _logp_grad(m, rollout, None, weights=weights)
    got_lp, got_ent, got_g = _logp_grad(m, rollout, G, weights=weights, padding_free=padding_free)
    real = rollout.attention_mask[:, rollout.prompt_len:].bool()
    torch.testing.assert_close(got_lp[real], want_lp[real])
    torch.testing.assert_close(got_ent[real], want_ent[real])
    if padding_free:  # padding columns are not computed
        assert bool((got_lp[~real] == 0).all()) and bool((got_ent[~real] == 0).all())
    # fp32 sums in another order (other GEMM shapes): close, not bit-identical
    torch.testing.assert_close(got_g, want_g, rtol=1e-4, atol=1e-6)
    assert m.config._attn_implementation == FAST_CPU_ATTENTION


def test_grouped_forward_differentiates_an_entropy_bonus(model, rollout):
    m = copy.deepcopy(model).train()
    _, want_ent, want_g = _logp_grad(m, rollout, None, entropy_grad=True)
    _, got_ent, got_g = _logp_grad(m, rollout, G, entropy_grad=True)
    real = rollout.attention_mask[:, rollout.prompt_len:].bool()
    torch.testing.assert_close(got_ent[real], want_ent[real])
    torch.testing.assert_close(got_g, want_g, rtol=1e-4, atol=1e-6)  # fp32 sums in another order, as above


@pytest.mark.parametrize("padding_free", [False, True], ids=["grouped", "packed-groups"])
def test_grouped_forward_in_bf16_is_as_close_to_fp32_as_the_padded_one(model, rollout, padding_free):
    m = copy.deepcopy(model).train()
    ref_lp, _, ref_g = _logp_grad(m, rollout, None)
    mask = rollout.loss_mask
    errors = {}
    for group_size in (None, G):
        lp, _, g = _logp_grad(m, rollout, group_size, dtype=torch.bfloat16,
                              padding_free=padding_free and group_size is not None)
        errors[group_size] = (float((lp - ref_lp)[mask].abs().max()), float((g - ref_g).norm() / ref_g.norm()))
    (pad_lp, pad_g), (grp_lp, grp_g) = errors[None], errors[G]
    # bf16 rounds in other places in the two layouts: the grouped error is of the padded one's size
    assert grp_lp <= 2 * pad_lp + 1e-3 and grp_g <= 2 * pad_g + 1e-3, errors


def test_batched_logprobs_in_whole_groups_equal_the_padded_passes(model, rollout):
    m = copy.deepcopy(model).eval()
    want = batched_logprobs(m, rollout, 1.0, batch_size=5)
    mask = rollout.loss_mask
    for batch_size in (G, 2 * G):
        for padding_free in (False, True):
            got = batched_logprobs(m, rollout, 1.0, batch_size=batch_size, shared_prompt=True, padding_free=padding_free)
            torch.testing.assert_close(got[mask], want[mask])
    with pytest.raises(ValueError, match="whole groups"):
        batched_logprobs(m, rollout, 1.0, batch_size=G + 1, shared_prompt=True)


def test_layout_scores_every_completion_token_from_its_own_row(rollout):
    """Each completion's first token is predicted by the prompt's last column, every later token by
    the column before it in its own block of the group row."""
    lay = shared_prompt.group_layout(rollout.input_ids, rollout.attention_mask, rollout.prompt_len, G)
    n, width = rollout.input_ids.shape
    lp, lc = rollout.prompt_len, width - rollout.prompt_len
    assert lay.input_ids.shape == (n // G, lp + G * lc)
    torch.testing.assert_close(lay.input_ids[:, :lp], rollout.input_ids[::G, :lp])
    torch.testing.assert_close(lay.input_ids[:, lp:].reshape(n, lc), rollout.input_ids[:, lp:])
    assert lay.predictors[0] == lp - 1 and lay.predictors.numel() == 1 + G * (lc - 1)
    # the column before each predicted token: the same token in the grouped row
    prev = lay.input_ids[:, lay.predictors[1:]].reshape(n // G, G, lc - 1)
    torch.testing.assert_close(prev, rollout.input_ids[:, lp:-1].reshape(n // G, G, lc - 1))
    # completion positions continue from the prompt's real length
    real = rollout.attention_mask[::G, :lp].sum(-1)
    torch.testing.assert_close(lay.position_ids[:, lp], real)
    torch.testing.assert_close(lay.position_ids[:, lp + lc], real)


def test_packed_layout_holds_each_prompt_once_and_every_row_through_its_maps(rollout):
    ids, am, lp = rollout.input_ids, rollout.attention_mask, rollout.prompt_len
    lay = shared_prompt.packed_group_layout(ids, am, lp, G)
    real = am.bool()
    k = int(real[::G, :lp].sum() + real[:, lp:].sum())
    assert lay.input_ids.shape == (1, k) and lay.expand.shape == (int(real.sum()),)
    torch.testing.assert_close(lay.input_ids[0, lay.expand], ids[real])  # every original row, rebuilt
    torch.testing.assert_close(lay.expand[lay.collapse], torch.arange(k))  # collapse picks a copy of each
    torch.testing.assert_close(lay.position_ids[0, lay.expand], (real.long().cumsum(-1) - 1)[real])
    torch.testing.assert_close(lay.row_lengths, real.sum(-1))
    # the predictor of each scored token is the token before it in its row, at that token's position
    torch.testing.assert_close(lay.input_ids[0, lay.predictors], ids[:, lp - 1 : -1][lay.scored])
    torch.testing.assert_close(lay.position_ids[0, lay.predictors] + 1, (real.long().cumsum(-1) - 1)[:, lp:][lay.scored])


@pytest.mark.parametrize("layout", ["group_layout", "packed_group_layout"])
def test_rows_that_are_not_whole_groups_are_rejected(rollout, layout):
    ids, am, lp = rollout.input_ids, rollout.attention_mask, rollout.prompt_len
    build = getattr(shared_prompt, layout)
    with pytest.raises(ValueError, match="whole groups"):
        build(ids[:-1], am[:-1], lp, G)
    order = torch.arange(rollout.num_sequences).roll(1)  # every group now starts with another group's row
    with pytest.raises(ValueError, match="share one prompt"):
        build(ids[order], am[order], lp, G)


def test_a_model_without_sdpa_attention_is_rejected(tok, rollout):
    m = build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    m.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="SDPA"):
        completion_logprobs(m, rollout.input_ids, rollout.attention_mask, rollout.prompt_len, group_size=G)


def test_group_permutation_keeps_each_group_together():
    order = shared_prompt.group_permutation(24, 4, torch.Generator().manual_seed(0))
    assert sorted(order.tolist()) == list(range(24))
    groups = order.view(-1, 4)
    assert bool((groups == groups[:, :1] + torch.arange(4)).all())
    assert groups[:, 0].tolist() != list(range(0, 24, 4))  # shuffled


def test_to_rows_puts_each_completion_in_a_row_behind_its_prompt():
    x = torch.randn(2, 3, 5 + 4 * 7, 8)  # U = 2 groups, H = 3, Lp = 5, G = 4 completions of Lc = 7, D = 8
    rows = shared_prompt.to_rows(x, 5, 4, True)
    assert rows.shape == (8, 3, 5 + 7, 8)
    torch.testing.assert_close(rows[6, :, :5], x[1, :, :5])  # group 1's prompt
    torch.testing.assert_close(rows[6, :, 5:], x[1, :, 5 + 2 * 7 : 5 + 3 * 7])  # its completion 2
    torch.testing.assert_close(shared_prompt.to_rows(x, 5, 4, False), rows[:, :, 5:])


@pytest.mark.parametrize("padding_free", [False, True], ids=["grouped", "packed-groups"])
def test_compiled_grouped_forward_keeps_its_graphs_for_other_widths(model, rollout, padding_free,
                                                                     compiled_keeps_graphs):
    """model.compile with model.shared_prompt: batches of other widths and group counts reuse the
    graphs compiled for the first one; log-probs and gradients are the eager ones. (A batch of one
    group compiles once more: dynamo specializes sizes of 1, as for a padded batch of one row.)"""
    rows = torch.arange(3 * G).view(3, G)
    first, second = rollout.select(rows[[0, 2]].flatten()), rollout.select(rows[[1, 2]].flatten())
    assert first.input_ids.shape[1] != second.input_ids.shape[1]
    compiled_keeps_graphs(model, first, (second, rollout), lambda m, ro: _logp_grad(m, ro, G, padding_free=padding_free),
                          "new widths recompiled the grouped forward")


def test_config_needs_whole_groups():
    from grpolab import config as C

    base = ["rollout.group_size=4", "model.shared_prompt=true"]
    cfg = C.from_preset("grpo", base + ["train.minibatch_size=16", "train.microbatch_size=8"])
    assert cfg.model.shared_prompt
    with pytest.raises(C.ConfigError, match="train.microbatch_size=2 is not a multiple of rollout.group_size=4"):
        C.from_preset("grpo", base + ["train.minibatch_size=16", "train.microbatch_size=2"])
    with pytest.raises(C.ConfigError, match="train.minibatch_size=2 is not a multiple of rollout.group_size=4"):
        C.from_preset("grpo", base + ["train.minibatch_size=2", "train.microbatch_size=2"])
    both = C.from_preset("grpo", base + ["train.minibatch_size=16", "train.microbatch_size=8", "model.padding_free=true"])
    assert both.model.shared_prompt and both.model.padding_free


def test_one_completion_column(model, tok):
    """Completions one column wide (max_new_tokens=1, or a microbatch trimmed to one column): every
    log-prob comes from a prompt's last position."""
    from grpolab.rollout.hf import HFEngine

    ro = HFEngine(tok, max_new_tokens=1).generate_with(model, ["1+1=", "12+34="], 3, generator=torch.Generator().manual_seed(0))
    assert ro.input_ids.shape[1] == ro.prompt_len + 1
    m = copy.deepcopy(model).train()
    want_lp, _, want_g = _logp_grad(m, ro, None)
    for padding_free in (False, True):
        got_lp, _, got_g = _logp_grad(m, ro, 3, padding_free=padding_free)
        torch.testing.assert_close(got_lp, want_lp)
        torch.testing.assert_close(got_g, want_g, rtol=1e-4, atol=1e-6)  # fp32 sums in another order, as above


def test_sliding_window_attention_is_rejected(tok, rollout):
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=2, sliding_window=4)
    cfg._attn_implementation = "sdpa"
    m = MistralForCausalLM(cfg)
    args = (rollout.input_ids, rollout.attention_mask, rollout.prompt_len)
    with pytest.raises(ValueError, match="sliding window"):
        completion_logprobs(m, *args, group_size=G)
    with pytest.raises(ValueError, match="sliding window"):
        completion_logprobs(m, *args, group_size=G, padding_free=True)
