"""The padding-free log-prob forward (model.padding_free): same log-probs and gradients as the padded one."""

from __future__ import annotations

import copy

import pytest
import torch

from grpolab.forward import batched_logprobs, completion_logprobs
from grpolab.forward.attention import FAST_CPU_ATTENTION
from grpolab.forward.layouts import packed_completion_logprobs
from grpolab.models.tiny import build_tiny_model


def _logp_grad(model, ro, padding_free, dtype=None, weights=None):
    model.zero_grad(set_to_none=True)
    logp, ent = completion_logprobs(model, ro.input_ids, ro.attention_mask, ro.prompt_len, 0.9, with_entropy=True,
                                    compute_dtype=dtype, padding_free=padding_free)
    w = weights if weights is not None else torch.ones_like(logp)
    (logp * w * ro.loss_mask).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return logp.detach(), ent, grads


def test_padding_free_matches_the_padded_forward_in_fp32(model, rollout):
    m = copy.deepcopy(model).train()
    weights = torch.randn(rollout.loss_mask.shape, generator=torch.Generator().manual_seed(2))
    want_lp, want_ent, want_g = _logp_grad(m, rollout, False, weights=weights)
    got_lp, got_ent, got_g = _logp_grad(m, rollout, True, weights=weights)
    real = rollout.attention_mask[:, rollout.prompt_len:]
    assert bool(rollout.loss_mask.le(real).all())
    torch.testing.assert_close(got_lp[real], want_lp[real])
    torch.testing.assert_close(got_ent[real], want_ent[real])
    assert bool((got_lp[~real] == 0).all()) and bool((got_ent[~real] == 0).all())
    # fp32 sums in another order (fewer rows, other GEMM blocking): close, not bit-identical
    torch.testing.assert_close(got_g, want_g, rtol=1e-4, atol=1e-6)
    assert m.config._attn_implementation == FAST_CPU_ATTENTION


def test_padding_free_in_bf16_matches_the_padded_bf16_forward_to_bf16_precision(model, rollout):
    m = copy.deepcopy(model).train()
    want_lp, _, want_g = _logp_grad(m, rollout, False, dtype=torch.bfloat16)
    got_lp, _, got_g = _logp_grad(m, rollout, True, dtype=torch.bfloat16)
    mask = rollout.loss_mask
    # bf16 autocast: both paths round to an 8-bit mantissa, in different places
    torch.testing.assert_close(got_lp[mask], want_lp[mask], rtol=0.02, atol=0.05)
    err = float((got_g - want_g).norm() / want_g.norm())
    assert err < 0.03, err


def test_batched_logprobs_padding_free_equals_padded(model, rollout):
    m = copy.deepcopy(model).eval()
    want = batched_logprobs(m, rollout, 1.0, batch_size=5)
    got = batched_logprobs(m, rollout, 1.0, batch_size=5, padding_free=True)
    mask = rollout.loss_mask
    torch.testing.assert_close(got[mask], want[mask])


def test_batched_logprobs_padding_free_in_bf16_matches_the_padded_bf16_forward(model, rollout):
    """The no-grad π_old / π_ref passes under bf16 autocast (attention inputs of mixed dtypes: the
    rotary embedding upcasts query and key, not value)."""
    m = copy.deepcopy(model).eval()
    want = batched_logprobs(m, rollout, 1.0, batch_size=5, compute_dtype=torch.bfloat16)
    got = batched_logprobs(m, rollout, 1.0, batch_size=5, compute_dtype=torch.bfloat16, padding_free=True)
    mask = rollout.loss_mask
    # bf16 autocast: both paths round to an 8-bit mantissa, in different places (as the bf16 test above)
    torch.testing.assert_close(got[mask], want[mask], rtol=0.02, atol=0.05)


def test_entropy_bonus_is_differentiated_through_the_packed_path(rollout, tok):
    m = build_tiny_model(tok, hidden_size=64, num_layers=2, num_heads=4, seed=0)
    grads = []
    for padding_free in (False, True):
        m.zero_grad(set_to_none=True)
        _, ent = completion_logprobs(m, rollout.input_ids, rollout.attention_mask, rollout.prompt_len,
                                     with_entropy=True, entropy_grad=True, padding_free=padding_free)
        assert ent.requires_grad
        (ent * rollout.loss_mask).sum().backward()
        grads.append(m.model.embed_tokens.weight.grad.clone())
    # fp32 sums in another order (fewer rows, other GEMM blocking), as in the fp32 test above
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)


def test_rows_with_a_gap_or_no_prompt_token_are_rejected(tok, rollout):
    m = build_tiny_model(tok, hidden_size=64, num_layers=2, num_heads=4, seed=0)
    am = rollout.attention_mask.clone()
    am[0, rollout.prompt_len + 1] = False  # a hole inside row 0's completion
    am[0, rollout.prompt_len + 2 :] = True
    with pytest.raises(ValueError, match="gap"):
        packed_completion_logprobs(m, rollout.input_ids, am, rollout.prompt_len)
    am = rollout.attention_mask.clone()
    am[1, : rollout.prompt_len] = False  # completion without a prompt
    with pytest.raises(ValueError, match="no prompt token"):
        packed_completion_logprobs(m, rollout.input_ids, am, rollout.prompt_len)


def test_a_model_without_sdpa_attention_is_rejected(tok, rollout):
    m = build_tiny_model(tok, hidden_size=64, num_layers=2, num_heads=4, seed=0)
    m.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="SDPA"):
        packed_completion_logprobs(m, rollout.input_ids, rollout.attention_mask, rollout.prompt_len)


def test_compiled_padding_free_forward_keeps_its_graphs_for_other_row_lengths(model, rollout, compiled_keeps_graphs):
    """model.compile with model.padding_free: the row lengths stay outside the traced code, so a batch
    with other rows (other count, lengths, width) reuses the graphs compiled for the first one, and
    its log-probs and gradients are the eager ones."""
    first, second = rollout.select(torch.arange(0, 6)), rollout.select(torch.arange(6, 11))
    assert first.attention_mask.sum(-1).tolist()[:5] != second.attention_mask.sum(-1).tolist()
    compiled_keeps_graphs(model, first, (second, rollout), lambda m, ro: _logp_grad(m, ro, True),
                          "a new set of rows recompiled the packed forward")


def test_config_accepts_padding_free_with_compile():
    from grpolab import config as C

    cfg = C.from_preset("grpo", ["model.padding_free=true", "model.compile=true"])
    assert cfg.model.padding_free and cfg.model.compile


def test_the_attention_switch_adds_no_graph_break_to_a_compiled_forward(tok):
    """model.compile traces the registered attention and mask functions: nothing in them (e.g. reading
    the padding-free state) may split the graph, for the training and the decode forward alike."""
    from grpolab.forward.attention import use_fast_cpu_attention

    m = build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    use_fast_cpu_attention(m, torch.bfloat16, "cpu")
    assert m.config._attn_implementation == FAST_CPU_ATTENTION
    ids = torch.randint(3, len(tok), (2, 6))
    am = torch.ones(2, 6, dtype=torch.long)
    am[0, :2] = 0
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = torch._dynamo.explain(m)(input_ids=ids, attention_mask=am, use_cache=False)
    assert report.graph_break_count == 0, report.break_reasons
