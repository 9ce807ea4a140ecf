"""The per-row attention operator of the padding-free forward: each row's causal SDPA, as one custom op."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from grpolab.forward.row_attention import per_row_attention

ROWS = [5, 17, 1, 9]


def _inputs(kv_heads: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    r = sum(ROWS)
    q = torch.randn(1, 6, r, 16, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(1, kv_heads, r, 16, generator=g).to(dtype).requires_grad_() for _ in range(2))
    return q, k, v


def _per_row_sdpa(q, k, v, scale):
    parts = [F.scaled_dot_product_attention(a, b, c, is_causal=True, scale=scale, enable_gqa=a.shape[1] != b.shape[1])
             for a, b, c in zip(q.split(ROWS, 2), k.split(ROWS, 2), v.split(ROWS, 2))]
    return torch.cat(parts, 2).transpose(1, 2)


@pytest.mark.parametrize("kv_heads", [6, 2])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_per_row_attention_is_each_row_s_causal_sdpa(kv_heads, scale):
    q, k, v = _inputs(kv_heads)
    out, lse = per_row_attention(q, k, v, torch.tensor(ROWS), scale)
    want = _per_row_sdpa(q, k, v, scale)
    assert out.shape == (1, sum(ROWS), 6, 16) and out.is_contiguous() and lse.shape == (1, 6, sum(ROWS))
    torch.testing.assert_close(out, want)
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    for got, expected in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(got, expected)


def test_a_row_attends_only_to_itself():
    q, k, v = _inputs(2)
    out, _ = per_row_attention(q, k, v, torch.tensor(ROWS))
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, ROWS[0]:] += 5.0  # change every row but the first
    v2[:, :, ROWS[0]:] -= 3.0
    out2, _ = per_row_attention(q.detach(), k2, v2, torch.tensor(ROWS))
    torch.testing.assert_close(out2[:, : ROWS[0]], out[:, : ROWS[0]].detach())
    assert not torch.allclose(out2[:, ROWS[0]:], out[:, ROWS[0]:].detach())


def test_per_row_attention_passes_torch_s_custom_op_checks():
    """Fake (meta) implementation, schema and autograd registration, as torch.compile relies on them."""
    q, k, v = _inputs(2)
    torch.library.opcheck(torch.ops.grpolab.per_row_attention.default, (q, k, v, torch.tensor(ROWS), 0.25))


def test_the_python_row_loop_for_dropout_and_other_devices_agrees_with_the_operator():
    """`plans.per_row_sdpa`, which `PackedRows.packed_attention` takes where the operator does not apply."""
    from grpolab.forward.plans import per_row_sdpa

    q, k, v = _inputs(2)
    loop = per_row_sdpa(q, k, v, torch.tensor(ROWS), 0.3, 0.0)
    torch.testing.assert_close(loop, per_row_attention(q, k, v, torch.tensor(ROWS), 0.3)[0])
