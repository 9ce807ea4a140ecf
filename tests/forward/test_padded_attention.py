"""The padded attention of a padding-free batch's short rows (forward/padded_attention.py) and the
padding of the packed row to few sizes (padded_count, dummy_rows)."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch

from grpolab.forward import plans
from grpolab.forward.attention import SHORT_ATTENTION_MAX_TOKENS
from grpolab.forward.plans import packed_rows_plan
from grpolab.forward import completion_logprobs
from grpolab.forward.math_attention import short_attention
from grpolab.forward.padded_attention import (
    dummy_rows,
    from_padded,
    from_padded_backward,
    padded_count,
    padded_maps,
    to_padded,
    to_padded_backward,
)

LENGTHS = torch.tensor([5, 1, 7, 3])


def _packed(heads: int, dtype=torch.float64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, heads, int(LENGTHS.sum()), 8, generator=g, dtype=dtype).requires_grad_()


def test_maps_gather_each_row_right_padded_and_scatter_back():
    gather, scatter, visible = padded_maps(LENGTHS)
    assert gather.tolist()[1] == [5, 0, 0, 0, 0, 0, 0] and gather.tolist()[2] == list(range(6, 13))
    x = _packed(3)
    slots = to_padded(x, gather)  # [n, H, L, D]
    for i, (start, n) in enumerate(zip((0, 5, 6, 13), LENGTHS.tolist())):
        torch.testing.assert_close(slots[i, :, :n], x[0, :, start : start + n])
        assert bool(visible[i, 0, :, n:].logical_not().all()) and bool(visible[i, 0, :n, :n].equal(
            torch.ones(n, n, dtype=torch.bool).tril()))
    torch.testing.assert_close(from_padded(slots.transpose(1, 2).contiguous(), scatter), x.transpose(1, 2))


def test_layout_changes_have_their_gradients_and_registered_operators():
    gather, scatter, _ = padded_maps(LENGTHS)
    x = _packed(3)
    torch.autograd.gradcheck(lambda t: to_padded(t, gather), (x,))
    y = torch.randn(4, 7, 3, 8, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t: from_padded(t, scatter), (y,))
    torch.library.opcheck(to_padded_backward, (torch.randn(4, 3, 7, 8, dtype=torch.float64), gather, 16))
    torch.library.opcheck(from_padded_backward, (torch.randn(1, 16, 3, 8, dtype=torch.float64), scatter, 4, 7))


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_short_rows_attention_equals_short_attention_row_by_row(kv_heads):
    """bf16 on a CPU (where the dispatch sends it): the same values and gradients as `short_attention`
    run on each row alone."""
    q, k, v = _packed(4, torch.bfloat16, 0), _packed(kv_heads, torch.bfloat16, 1), _packed(kv_heads, torch.bfloat16, 2)
    w = torch.randn(1, int(LENGTHS.sum()), 4, 8, generator=torch.Generator().manual_seed(3))
    got = packed_rows_plan(LENGTHS).short_rows_attention(q, k, v)
    got_grads = torch.autograd.grad((got.float() * w).sum(), (q, k, v))
    sizes = LENGTHS.tolist()
    want = torch.cat([short_attention(a, b, c) for a, b, c in zip(q.split(sizes, 2), k.split(sizes, 2), v.split(sizes, 2))], 1)
    want_grads = torch.autograd.grad((want.float() * w).sum(), (q, k, v))
    torch.testing.assert_close(got, want)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b)


def test_grouped_maps_read_each_prompt_into_each_row_and_sum_its_key_gradients():
    """With shared prompts: rows (prompt p | completion) over distinct tokens [p, c0, c1]; the padded
    attention equals the attention of the rows written out, and a prompt key's gradient sums over rows."""
    p, c0, c1 = 3, 2, 4
    rows = torch.tensor([p + c0, p + c1])
    k_tokens = p + c0 + c1
    expand = torch.cat([torch.arange(p + c0), torch.arange(p), torch.arange(p + c0, k_tokens)])  # [R]
    collapse = torch.cat([torch.arange(p + c0), torch.arange(p + c0 + p, p + c0 + p + c1)])  # [K]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, k_tokens, 8, generator=g, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    got = packed_rows_plan(rows, (expand, collapse)).short_rows_attention(q, k, v)
    (got.float().sum()).backward()
    got_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    written = [t.index_select(2, expand) for t in (q, k, v)]
    outs = [short_attention(*(t[:, :, a:b] for t in written)) for a, b in ((0, p + c0), (p + c0, 2 * p + c0 + c1))]
    want = torch.cat(outs, 1).index_select(1, collapse)
    (want.float().sum()).backward()
    torch.testing.assert_close(got, want)
    for t, a in zip((q, k, v), got_grads):
        torch.testing.assert_close(a, t.grad)


def test_packed_forward_takes_the_padded_attention_in_bf16_and_in_fp32(model, rollout):
    m = copy.deepcopy(model)
    calls = []

    def counting(x, gather):
        calls.append(gather.shape)
        return to_padded(x, gather)

    with (mock.patch.object(plans, "to_padded", counting),
          mock.patch.object(plans, "per_row_attention", side_effect=AssertionError("per-row attention"))):
        completion_logprobs(m, rollout.input_ids, rollout.attention_mask, rollout.prompt_len,
                            compute_dtype=torch.bfloat16, padding_free=True)
        assert len(calls) == 3 * m.config.num_hidden_layers  # query, key, value of every layer
        calls.clear()
        completion_logprobs(m, rollout.input_ids, rollout.attention_mask, rollout.prompt_len, padding_free=True)
        assert len(calls) == 3 * m.config.num_hidden_layers  # float32: one SDPA call over the padded rows


def test_fp32_padded_sdpa_matches_the_per_row_attention_values_and_gradients():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 1, 9, 3])
    q, k, v = (torch.randn(1, 4, int(lengths.sum()), 8, generator=g, requires_grad=True) for _ in range(3))
    plan = packed_rows_plan(lengths)
    padded = plan.short_rows_sdpa(q, k, v)
    per_row = plan.packed_attention(torch.nn.Module(), q, k, v)
    torch.testing.assert_close(padded, per_row)
    up = torch.randn(padded.shape, generator=g)
    grads = torch.autograd.grad((padded * up).sum(), (q, k, v))
    expected = torch.autograd.grad((per_row * up).sum(), (q, k, v))
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b)


def test_packed_rows_plan_builds_the_padded_maps_only_for_short_rows_on_a_cpu():
    assert packed_rows_plan(LENGTHS).padded is not None
    assert packed_rows_plan(LENGTHS, device="cuda").padded is None  # the padded attention is a CPU path
    assert packed_rows_plan(torch.tensor([SHORT_ATTENTION_MAX_TOKENS + 1, 3])).padded is None


def test_padded_count_gives_few_sizes_and_little_padding():
    for n in range(1, 5000):
        c = padded_count(n)
        assert n <= c <= n + max(7, n // 16), n
    assert len({padded_count(n) for n in range(1025, 2049)}) == 16  # 1088, 1152, ..., 2048
    assert padded_count(0) == 0


@pytest.mark.parametrize("longest", [3, 16, 38, 64, 200])
def test_dummy_rows_fill_to_a_padded_size_no_longer_than_the_rows_and_as_many_for_any_shortfall(longest):
    """Dummy rows no longer than the longest real row (at least 16, at most 64 tokens) keep the
    padded attention's width, and their count does not depend on the shortfall: a few row counts
    (so few attention kernels) instead of one per microbatch."""
    width = max(16, min(64, longest))
    counts = set()
    for tokens in range(1024, 2048):  # one padding step (64)
        for predictors in (0, tokens // 2, tokens - 1, tokens):
            rows = dummy_rows(tokens, predictors, longest)
            total = tokens + sum(rows)
            assert total == padded_count(total) and total > padded_count(predictors), (tokens, predictors)
            assert 1 <= min(rows) and max(rows) <= width, (tokens, predictors, rows)
            if predictors < tokens - 64:  # the predictors force no more tokens than the rounding does
                counts.add(len(rows))
    assert len(counts) == 1, counts


def test_packed_forward_feeds_the_model_few_sizes_and_more_tokens_than_predictors(model, rollout):
    """Every bf16 matrix product of a new size makes oneDNN build and keep a kernel: the packed row
    and the LM head's rows are padded to `padded_count` sizes, the tokens stay more than the
    predictors (else torch.compile ties the two sizes in its guards), and the padded attention is
    as wide as the longest real row (the dummy rows are no longer)."""
    m = copy.deepcopy(model)
    seen, widths, longest = [], [], []

    def record(mod, args, kwargs):
        seen.append((kwargs["input_ids"].shape[1], kwargs["logits_to_keep"].numel()))
        widths.append(kwargs["grpolab_plan"].padded[0].shape[1])

    hook = m.register_forward_pre_hook(record, with_kwargs=True)
    try:
        for rows in (torch.arange(0, 6), torch.arange(3, 12), torch.arange(12)):
            sub = rollout.select(rows)
            for group_size in (None, 4):  # the rollout's groups: rows 4g .. 4g + 3
                if group_size and len(rows) != 12:
                    continue
                completion_logprobs(m, sub.input_ids, sub.attention_mask, sub.prompt_len, padding_free=True,
                                    group_size=group_size)
                longest.append(int(sub.attention_mask.sum(1).max()))
    finally:
        hook.remove()
    assert seen and all(w == n or n < w <= 16 for w, n in zip(widths, longest, strict=True)), (widths, longest)
    for tokens, predictors in seen:
        assert tokens == padded_count(tokens) and predictors == padded_count(predictors) and tokens > predictors


@pytest.mark.parametrize("group_size", [None, 4])
def test_compiled_bf16_packed_forward_keeps_its_graphs_for_other_rows(model, rollout, group_size):
    """The padded attention's maps reach the traced code as tensors: batches with other rows, row
    lengths and counts reuse the graphs compiled for the first one (forward and backward)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    m = copy.deepcopy(model).train()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(m, dynamic=True, backend=counter)
    batches = ([rollout.select(torch.arange(0, 8)), rollout.select(torch.arange(4, 12)), rollout] if group_size
               else [rollout.select(torch.arange(0, 6)), rollout.select(torch.arange(6, 11)), rollout])
    frames = None
    for ro in batches:
        m.zero_grad(set_to_none=True)
        logp, _ = completion_logprobs(compiled, ro.input_ids, ro.attention_mask, ro.prompt_len,
                                      compute_dtype=torch.bfloat16, padding_free=True, group_size=group_size)
        (logp * ro.loss_mask).sum().backward()
        assert all(p.grad is not None for p in m.parameters() if p.requires_grad)
        frames = counter.frame_count if frames is None else frames
        assert counter.frame_count == frames, "other rows recompiled the padded attention"
    torch._dynamo.reset()
