import pytest
import torch

from grpolab.algo import logprobs
from grpolab.algo.logprobs import entropy, fused_token_logprobs, sequence_logprob, token_logprobs


def test_token_logprobs_matches_log_softmax_and_chunks():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 17, requires_grad=True)
    labels = torch.randint(0, 17, (3, 5))
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, labels[..., None]).squeeze(-1)
    for chunk in (1, 4, 2048):
        got = token_logprobs(logits, labels, temperature=0.7, chunk_rows=chunk)
        torch.testing.assert_close(got, ref)
    g1 = torch.autograd.grad(token_logprobs(logits, labels, 0.7, chunk_rows=4).sum(), logits)[0]
    g2 = torch.autograd.grad(ref.sum(), logits)[0]
    torch.testing.assert_close(g1, g2)


def test_token_logprobs_bf16_input_returns_fp32():
    logits = torch.randn(2, 3, 9).to(torch.bfloat16)
    labels = torch.randint(0, 9, (2, 3))
    out = token_logprobs(logits, labels)
    assert out.dtype == torch.float32
    ref = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(out, ref)


def test_entropy():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(entropy(logits), torch.tensor([torch.log(torch.tensor(4.0)).item(), 0.0]), atol=1e-5, rtol=0)
    torch.manual_seed(1)
    z = torch.randn(2, 3, 13)
    p = torch.softmax(z / 1.3, -1)
    torch.testing.assert_close(entropy(z, 1.3, chunk_rows=2), -(p * p.log()).sum(-1))


def test_sequence_logprob():
    lp = torch.tensor([[-1.0, -2.0, -5.0]])
    m = torch.tensor([[True, True, False]])
    torch.testing.assert_close(sequence_logprob(lp, m), torch.tensor([-3.0]))
    torch.testing.assert_close(sequence_logprob(lp, m, mean=True), torch.tensor([-1.5]))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_token_logprobs_matches_the_reference_values_and_gradient(temperature, monkeypatch):
    monkeypatch.setattr(logprobs, "_FUSED_CHUNK_ELEMENTS", 3 * 50)  # several chunks of 3 rows
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 7, 50, generator=g)
    labels = torch.randint(0, 50, (2, 7), generator=g)
    weights = torch.randn(2, 7, generator=g)
    x, y = base.clone().requires_grad_(True), base.clone().requires_grad_(True)
    ref = token_logprobs(x, labels, temperature)
    got, ent = fused_token_logprobs(y, labels, temperature, with_entropy=True)
    (ref * weights).sum().backward()
    (got * weights).sum().backward()
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(ent, entropy(base, temperature))
    torch.testing.assert_close(y.grad, x.grad)
    torch.testing.assert_close(y.detach(), base)  # the input is not modified in place
    assert not ent.requires_grad


def test_fused_token_logprobs_bf16_logits_give_bf16_gradient():
    x = torch.randn(4, 33).to(torch.bfloat16).requires_grad_(True)
    logp, ent = fused_token_logprobs(x, torch.randint(0, 33, (4,)))
    logp.sum().backward()
    assert ent is None and logp.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
