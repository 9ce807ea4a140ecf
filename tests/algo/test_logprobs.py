import torch

from grpolab.algo.logprobs import entropy, sequence_logprob, token_logprobs


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
