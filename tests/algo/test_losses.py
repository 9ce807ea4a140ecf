import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpolab.algo.losses import (
    AGGREGATIONS,
    agg_normalizer,
    aggregate,
    clipped_surrogate,
    kl_penalty,
    masked_mean,
    divergence_pairwise_logsigmoid,
    pairwise_logsigmoid,
    sequence_clipped_surrogate,
    sft_nll,
    weighted_nll,
)

E = math.e
# every aggregation but the deliberately microbatch-dependent ones (bnpo): the exactness rule holds for these
INVARIANT_AGGREGATIONS = [mode for mode, agg in AGGREGATIONS.items() if not agg.per_microbatch]


def test_clip_upper_for_positive_advantage():
    logp = torch.tensor([[1.0, 0.0]], requires_grad=True)  # ratio e, then 1
    old = torch.zeros(1, 2)
    loss, st_ = clipped_surrogate(logp, old, torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool))
    torch.testing.assert_close(loss.detach(), torch.tensor([[-1.2, -1.0]]))
    loss.sum().backward()
    # clipped token: no gradient; unclipped: d(-ρA)/dlogp = -ρA = -1
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -1.0]]))
    assert st_["clipped_high"].tolist() == [[True, False]] and not st_["clipped_low"].any()


def test_clip_lower_for_negative_advantage():
    logp = torch.tensor([[-1.0, -0.1]], requires_grad=True)  # ratio 1/e < 0.8, then 0.905
    loss, st_ = clipped_surrogate(logp, torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2, dtype=torch.bool))
    torch.testing.assert_close(loss.detach(), torch.tensor([[0.8, math.exp(-0.1)]]))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, math.exp(-0.1)]]))
    assert st_["clipped_low"].tolist() == [[True, False]]


def test_no_clip_where_it_would_help():
    # ratio e with A < 0: the unclipped term is the min, so it is used (pessimistic bound)
    loss, st_ = clipped_surrogate(torch.tensor([[1.0]]), torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1, dtype=torch.bool))
    torch.testing.assert_close(loss, torch.tensor([[E]]))
    assert not st_["clipped_low"].any() and not st_["clipped_high"].any()


def test_asymmetric_clip_higher():
    logp = torch.tensor([[math.log(1.25), math.log(1.3)]])
    loss, _ = clipped_surrogate(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool), 0.2, 0.28)
    torch.testing.assert_close(loss, torch.tensor([[-1.25, -1.28]]))


def test_dual_clip_caps_negative_advantage_loss():
    logp = torch.tensor([[math.log(10.0), math.log(2.0)]], requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    plain, _ = clipped_surrogate(logp, torch.zeros(1, 2), torch.tensor([-1.0]), mask)
    torch.testing.assert_close(plain.detach(), torch.tensor([[10.0, 2.0]]))
    dual, _ = clipped_surrogate(logp, torch.zeros(1, 2), torch.tensor([-1.0]), mask, dual_clip=3.0)
    torch.testing.assert_close(dual.detach(), torch.tensor([[3.0, 2.0]]))
    dual.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 2.0]]))
    # positive advantages are untouched by the dual clip
    pos, _ = clipped_surrogate(logp.detach(), torch.zeros(1, 2), torch.tensor([1.0]), mask, dual_clip=3.0)
    torch.testing.assert_close(pos, torch.tensor([[-1.2, -1.2]]))


def test_log_ratio_is_clamped():
    loss, st_ = clipped_surrogate(torch.tensor([[1000.0]]), torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1, dtype=torch.bool))
    assert torch.isfinite(loss).all() and torch.isfinite(st_["ratio"]).all()


def test_ratio_one_gradient_equals_weighted_loglik():
    torch.manual_seed(0)
    logits = torch.randn(4, 5, 7, requires_grad=True)
    labels = torch.randint(0, 7, (4, 5))
    adv = torch.randn(4)
    mask = torch.rand(4, 5) > 0.3

    def grad(fn):
        logits.grad = None
        logp = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        per_tok, _ = fn(logp, logp.detach(), adv, mask)
        aggregate(per_tok, mask, "token-mean", agg_normalizer(mask, "token-mean")).backward()
        return logits.grad.clone()

    g_clip = grad(clipped_surrogate)
    g_nll = grad(weighted_nll)
    torch.testing.assert_close(g_clip, g_nll)
    assert g_clip.abs().sum() > 0


def test_gspo_sequence_ratio():
    logp = torch.tensor([[0.2, 0.4, 9.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    loss, st_ = sequence_clipped_surrogate(logp, torch.zeros(1, 3), torch.tensor([1.0]), mask, 0.5, 0.5)
    s = math.exp(0.3)  # mean log-ratio over the counted tokens only
    torch.testing.assert_close(st_["ratio"][0, :2], torch.tensor([s, s]))
    aggregate(loss, mask, "seq-mean-token-mean", torch.tensor(1.0)).backward()
    # d/dlogp_t of -s·A via mean_t: -s/2 per counted token, 0 on the padding
    torch.testing.assert_close(logp.grad, torch.tensor([[-s / 2, -s / 2, 0.0]]))


def test_kl_estimators():
    lp = torch.tensor([[-1.0, -2.0]])
    for est in ("k1", "k2", "k3"):
        torch.testing.assert_close(kl_penalty(lp, lp, est), torch.zeros(1, 2))
    ref = torch.tensor([[-1.5, -1.0]])
    d = ref - lp  # [-0.5, 1.0]
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), -d)
    torch.testing.assert_close(kl_penalty(lp, ref, "k2"), 0.5 * d**2)
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), torch.exp(d) - d - 1)
    assert (kl_penalty(lp, ref, "k3") >= 0).all()
    with pytest.raises(ValueError):
        kl_penalty(lp, ref, "k4")


def test_k3_is_unbiased_estimate_of_kl():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(6), 0)
    q = torch.softmax(torch.randn(6), 0)
    exact = (p * (p.log() - q.log())).sum()
    samples = torch.multinomial(p, 400_000, replacement=True)
    est = kl_penalty(p.log()[samples][None], q.log()[samples][None], "k3").mean()
    torch.testing.assert_close(est, exact, atol=0.01, rtol=0.0)  # Monte-Carlo error ~1e-3


def test_aggregation_hand_values_and_padding():
    per_tok = torch.tensor([[1.0, 2.0, 999.0], [3.0, 999.0, 999.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    n = lambda m: agg_normalizer(mask, m, constant_len=4)  # noqa: E731
    torch.testing.assert_close(aggregate(per_tok, mask, "token-mean", n("token-mean")), torch.tensor(2.0))
    torch.testing.assert_close(aggregate(per_tok, mask, "seq-mean-token-mean", n("seq-mean-token-mean")), torch.tensor(2.25))
    torch.testing.assert_close(aggregate(per_tok, mask, "seq-mean-token-sum", n("seq-mean-token-sum")), torch.tensor(3.0))
    torch.testing.assert_close(aggregate(per_tok, mask, "constant", n("constant")), torch.tensor(6.0 / 8))
    # a NaN/inf in padding must not leak: multiplication by a 0 mask would give NaN, so check
    per_tok_bad = per_tok.clone()
    per_tok_bad[0, 2] = 1e30
    torch.testing.assert_close(aggregate(per_tok_bad, mask, "token-mean", n("token-mean")), torch.tensor(2.0))


def test_masked_mean():
    x = torch.tensor([[1.0, 5.0], [3.0, 7.0]])
    m = torch.tensor([[True, False], [True, False]])
    torch.testing.assert_close(masked_mean(x, m), torch.tensor(2.0))
    torch.testing.assert_close(masked_mean(x, torch.zeros_like(m)), torch.tensor(0.0))


def test_sft_nll_is_per_response_mean_then_batch_mean():
    logp = torch.log(torch.tensor([[0.5, 0.25, 1.0], [0.125, 1.0, 1.0]]))
    mask = torch.tensor([[True, True, False], [True, False, False]])
    expected = ((-math.log(0.5) - math.log(0.25)) / 2 + (-math.log(0.125))) / 2
    torch.testing.assert_close(sft_nll(logp, mask), torch.tensor(expected))


def test_pairwise_logsigmoid():
    c = torch.tensor([2.0, 0.0])
    r = torch.tensor([1.0, 0.0])
    torch.testing.assert_close(pairwise_logsigmoid(c, r), torch.tensor([math.log1p(math.exp(-1.0)), math.log(2.0)]))
    torch.testing.assert_close(pairwise_logsigmoid(c, r, margin=1.0)[0], torch.tensor(math.log(2.0)))


# --------------------------------------------------------------------------- microbatch invariance
def _problem(seed=0, n=8, L=6, V=11):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(V, 4, generator=g, dtype=torch.float64)
    x = torch.randn(n, L, 4, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (n, L), generator=g)
    lengths = torch.tensor([6, 1, 3, 6, 2, 5, 4, 3])[:n]  # sequences of different lengths
    mask = torch.arange(L)[None] < lengths[:, None]
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    old = torch.log_softmax(x @ W.T, -1).gather(-1, labels[..., None]).squeeze(-1) + 0.1 * torch.randn(n, L, generator=g, dtype=torch.float64)
    ref = old + 0.2 * torch.randn(n, L, generator=g, dtype=torch.float64)
    return W, x, labels, mask, adv, old, ref


def _loss_grad(W, x, labels, mask, adv, old, ref, mode, splits, per_micro_normalizer=False):
    """Gradient of W for one minibatch split into microbatches `splits` (lists of row indices)."""
    W = W.clone().requires_grad_(True)
    normalizer = agg_normalizer(mask, mode, constant_len=6)
    for rows in splits:
        idx = torch.tensor(rows)
        logp = torch.log_softmax(x[idx] @ W.T, -1).gather(-1, labels[idx][..., None]).squeeze(-1)
        per_tok, stats = clipped_surrogate(logp, old[idx], adv[idx], mask[idx])
        per_tok = per_tok + 0.04 * kl_penalty(logp, ref[idx], "k3") * stats["ratio"]
        norm = agg_normalizer(mask[idx], mode, constant_len=6) if per_micro_normalizer else normalizer
        aggregate(per_tok, mask[idx], mode, norm).backward()
    return W.grad


SPLITS = {
    "whole": [list(range(8))],
    "1xN": [[i] for i in range(8)],
    "Nx1": [list(range(8))],
    "uneven": [[0, 1, 2], [3], [4, 5, 6, 7]],
    "two_ranks": [[0, 2, 4, 6], [1, 3, 5, 7]],  # ranks: sum of grads == DDP sum; normalizer is global
}


@pytest.mark.parametrize("mode", INVARIANT_AGGREGATIONS)
@pytest.mark.parametrize("split", ["1xN", "uneven", "two_ranks"])
def test_microbatch_and_rank_invariance(mode, split):
    p = _problem()
    whole = _loss_grad(*p, mode, SPLITS["whole"])
    parts = _loss_grad(*p, mode, SPLITS[split])
    torch.testing.assert_close(parts, whole)
    assert whole.abs().sum() > 0


def test_two_ranks_with_rank_local_microbatches():
    # Two simulated ranks, each with its own uneven microbatches; the normalizer is summed across ranks.
    W, x, labels, mask, adv, old, ref = _problem(seed=1)
    for mode in INVARIANT_AGGREGATIONS:
        whole = _loss_grad(W, x, labels, mask, adv, old, ref, mode, SPLITS["whole"])
        rank_grads = []
        for rank_rows in ([0, 1, 2, 3], [4, 5, 6, 7]):
            Wr = W.clone().requires_grad_(True)
            n_global = agg_normalizer(mask, mode, constant_len=6)  # all-reduce(sum) of rank normalizers
            n_ranks = agg_normalizer(mask[:4], mode, 6) + agg_normalizer(mask[4:], mode, 6)
            torch.testing.assert_close(n_ranks, n_global)
            for micro in (rank_rows[:1], rank_rows[1:]):
                idx = torch.tensor(micro)
                logp = torch.log_softmax(x[idx] @ Wr.T, -1).gather(-1, labels[idx][..., None]).squeeze(-1)
                per_tok, _ = clipped_surrogate(logp, old[idx], adv[idx], mask[idx])
                aggregate(per_tok, mask[idx], mode, n_ranks).backward()
            rank_grads.append(Wr.grad)
        # the KL term is left out here, so compare against the same objective without it
        Wn = W.clone().requires_grad_(True)
        logp = torch.log_softmax(x @ Wn.T, -1).gather(-1, labels[..., None]).squeeze(-1)
        per_tok, _ = clipped_surrogate(logp, old, adv, mask)
        aggregate(per_tok, mask, mode, agg_normalizer(mask, mode, 6)).backward()
        torch.testing.assert_close(rank_grads[0] + rank_grads[1], Wn.grad)
        assert whole is not None


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_per_microbatch_normalizer_would_break_invariance(mode):
    # Guards the invariance tests themselves: the naive per-microbatch mean differs.
    p = _problem()
    whole = _loss_grad(*p, mode, SPLITS["whole"])
    naive = _loss_grad(*p, mode, SPLITS["uneven"], per_micro_normalizer=True)
    assert not torch.allclose(naive, whole)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 6),
    L=st.integers(1, 7),
    mode=st.sampled_from(list(AGGREGATIONS)),
    seed=st.integers(0, 10_000),
)
def test_property_masks_and_shapes(n, L, mode, seed):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, L, generator=g)
    old = logp + 0.3 * torch.randn(n, L, generator=g)
    mask = torch.rand(n, L, generator=g) > 0.4
    adv = torch.randn(n, generator=g)
    for fn in (clipped_surrogate, sequence_clipped_surrogate, weighted_nll):
        per_tok, stats = fn(logp, old, adv, mask)
        assert per_tok.shape == (n, L)
        assert all(v.shape == (n, L) for v in stats.values())
        total = aggregate(per_tok, mask, mode, agg_normalizer(mask, mode, constant_len=L))
        assert total.dim() == 0 and torch.isfinite(total)
        # changing values at masked-out positions changes nothing
        noisy = torch.where(mask, per_tok, per_tok + 123.0)
        torch.testing.assert_close(aggregate(noisy, mask, mode, agg_normalizer(mask, mode, L)), total)


def test_importance_ratio_is_clamped_exp():
    from grpolab.algo.losses import LOG_RATIO_CLAMP, importance_ratio

    lp = torch.tensor([[0.0, -1.0, 100.0]])
    old = torch.tensor([[0.0, 0.0, 0.0]])
    torch.testing.assert_close(importance_ratio(lp, old), torch.tensor([[1.0, math.exp(-1.0), math.exp(LOG_RATIO_CLAMP)]]))


def test_divergence_pairwise_logsigmoid_compares_the_first_differing_token():
    # rows: part at position 2; identical; chosen is a strict prefix (ends, no comparison);
    # part at position 0; rejected longer but parts at a real token (position 3: EOS=9 vs 4)
    c_ids = torch.tensor([[1, 2, 3, 9, 0], [1, 2, 5, 9, 0], [1, 2, 3, 0, 0], [7, 2, 0, 0, 0], [1, 2, 3, 9, 0]])
    r_ids = torch.tensor([[1, 2, 4, 9, 0], [1, 2, 5, 9, 0], [1, 2, 3, 4, 9], [6, 2, 0, 0, 0], [1, 2, 3, 4, 9]])
    c_s = torch.arange(25.0).view(5, 5) / 10
    r_s = -torch.arange(25.0).view(5, 5) / 10
    got = divergence_pairwise_logsigmoid(c_s, r_s, c_ids, r_ids, c_ids != 0, r_ids != 0)
    sp = torch.nn.functional.softplus
    want = torch.stack([sp(r_s[0, 2] - c_s[0, 2]), torch.tensor(0.0), torch.tensor(0.0),
                        sp(r_s[3, 0] - c_s[3, 0]), sp(r_s[4, 3] - c_s[4, 3])])
    torch.testing.assert_close(got, want)
    c_s.requires_grad_(True)
    divergence_pairwise_logsigmoid(c_s, r_s, c_ids, r_ids, c_ids != 0, r_ids != 0).sum().backward()
    assert (c_s.grad != 0).sum() == 3  # one position per compared pair, nothing elsewhere
