import pytest
import torch

from grpolab.forward.math_attention import short_attention


def _right_padded(kv_heads, lengths, width=9, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(len(lengths) + kv_heads)
    q = torch.randn(len(lengths), 4, width, 16, generator=g).to(dtype)
    k, v = (torch.randn(len(lengths), kv_heads, width, 16, generator=g).to(dtype) for _ in range(2))
    real = torch.arange(width)[None] < torch.tensor(lengths)[:, None]
    visible = torch.ones(width, width, dtype=torch.bool).tril()[None, None] & real[:, None, None, :]
    return q, k, v, visible


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_the_promise_of_visible_keys_skips_only_a_no_op(kv_heads):
    """Causal over right-padded rows (each row at least one token): every query sees a key, so
    skipping the zeroing of fully masked queries changes nothing, values nor gradients."""
    q, k, v, visible = _right_padded(kv_heads, [9, 4, 1, 6])
    grad_out = torch.randn(4, 9, 4, 16, generator=torch.Generator().manual_seed(3))
    results = []
    for promise in (False, True):
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = short_attention(*inputs, visible, every_query_sees_a_key=promise)
        out.float().backward(grad_out)
        results.append([out] + [x.grad for x in inputs])
    for plain, promised in zip(*results):
        torch.testing.assert_close(promised, plain, rtol=0, atol=0)


def test_a_fully_masked_query_gets_zero_unless_promised_otherwise():
    q, k, v, visible = _right_padded(2, [9, 9])
    visible = visible.clone()
    visible[1, :, :3] = False  # row 1: its first three queries see nothing
    out = short_attention(q, k, v, visible)
    assert out[1, :3].abs().max() == 0 and out[1, 3:].abs().max() > 0
    # the promise broken: those queries get the softmax of equal scores (the mean of the values)
    broken = short_attention(q, k, v, visible, every_query_sees_a_key=True)
    mean_of_values = v[1].float().mean(1).repeat_interleave(2, 0)  # [4 query heads, 16]: kv head j // 2
    # bf16 tolerance: the probabilities (1/9) and the output are rounded to bf16
    torch.testing.assert_close(broken[1, :3].float(), mean_of_values.expand(3, 4, 16), rtol=0.02, atol=0.02)
    torch.testing.assert_close(broken[:, 3:], out[:, 3:], rtol=0, atol=0)


def test_mask_none_is_causal():
    q, k, v, _ = _right_padded(4, [9, 9])
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    torch.testing.assert_close(short_attention(q, k, v), short_attention(q, k, v, causal), rtol=0, atol=0)
