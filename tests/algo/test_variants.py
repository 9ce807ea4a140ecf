"""The variants the peers define (issue 43): TRL's CISPO and SAPO losses, bnpo normalizer,
scale_rewards="batch" and normalize-then-sum; verl's abs and low_var_kl estimators, token-sum
aggregation and KL-in-reward. Each is pinned on tiny tensors with values computed by hand from the
peer's definition (the formulas are written out here, not taken from grpolab)."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from grpolab.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    STD_MODES,
    batch_normalize,
    batch_std,
    group_normalize,
    group_std,
    make_advantage_fn,
)
from grpolab.algo.kl import KL_ESTIMATORS, kl_k1, kl_k3, sequence_kl
from grpolab.algo.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    agg_normalizer,
    aggregate,
    cispo,
    clipped_surrogate,
    sapo,
    weighted_nll,
)
from grpolab.rewards.base import combine

LN = math.log


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ----------------------------------------------------------------------------- CISPO (TRL loss_type="cispo")
def test_cispo_hand_values_weight_capped_and_detached():
    # ρ = 2 (under ε_max = 5) and ρ = 8 (capped at 5); A = 1.5. TRL: -clamp(ρ, max=ε_max).detach() · A · log π
    logp = torch.tensor([[LN(0.5), LN(0.8)]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[LN(0.25), LN(0.1)]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, st = cispo(logp, old, torch.tensor([1.5], dtype=torch.float64), mask, cispo_ratio_max=5.0)
    want = torch.tensor([[-2 * 1.5 * LN(0.5), -5 * 1.5 * LN(0.8)]], dtype=torch.float64)  # [2.0794, 1.6736]
    torch.testing.assert_close(loss.detach(), want)
    loss.sum().backward()
    # the weight is detached: d/dlogp = -w·A for every token, the capped one included
    torch.testing.assert_close(logp.grad, torch.tensor([[-3.0, -7.5]], dtype=torch.float64))
    assert st["clipped_high"].tolist() == [[False, True]] and not st["clipped_low"].any()
    torch.testing.assert_close(st["ratio"], torch.tensor([[2.0, 8.0]], dtype=torch.float64))


def test_cispo_keeps_the_gradient_where_the_ppo_clip_drops_it():
    logp = torch.tensor([[LN(0.8)]], requires_grad=True)
    old = torch.tensor([[LN(0.1)]])  # ρ = 8 > 1 + ε, A > 0: PPO's clip gives no gradient
    adv, mask = torch.tensor([1.0]), torch.ones(1, 1, dtype=torch.bool)
    ppo, _ = clipped_surrogate(logp, old, adv, mask)
    assert torch.autograd.grad(ppo.sum(), logp)[0].item() == 0.0
    loss, _ = cispo(logp, old, adv, mask, cispo_ratio_max=5.0)
    torch.testing.assert_close(torch.autograd.grad(loss.sum(), logp)[0], torch.tensor([[-5.0]]))


def test_cispo_on_policy_is_weighted_nll():
    # ρ ≡ 1 (old = logp): CISPO is -A · log π, the REINFORCE loss
    logp = torch.tensor([[-0.3, -1.2], [-2.0, -0.1]])
    adv, mask = torch.tensor([0.7, -1.3]), torch.ones(2, 2, dtype=torch.bool)
    torch.testing.assert_close(cispo(logp, logp, adv, mask)[0], weighted_nll(logp, logp, adv, mask)[0])


# ----------------------------------------------------------------------------- SAPO (TRL loss_type="sapo")
def test_sapo_hand_values_with_trl_temperatures():
    # TRL: τ = 1.0 where A > 0, 1.05 where A ≤ 0; loss = -σ(τ(ρ - 1)) · 4/τ · A
    logp = torch.tensor([[0.0, LN(1.5)], [LN(0.5), 0.0]], dtype=torch.float64)
    old = torch.zeros(2, 2, dtype=torch.float64)  # ρ = [[1, 1.5], [0.5, 1]]
    adv = torch.tensor([2.0, -1.0], dtype=torch.float64)
    loss, st = sapo(logp, old, adv, torch.ones(2, 2, dtype=torch.bool))
    want = torch.tensor([
        [-_sigmoid(0.0) * 4 / 1.0 * 2.0, -_sigmoid(0.5) * 4 / 1.0 * 2.0],            # [-4.0, -4.9797]
        [_sigmoid(1.05 * -0.5) * 4 / 1.05, _sigmoid(0.0) * 4 / 1.05],                # [1.4159, 1.9048]
    ], dtype=torch.float64)
    torch.testing.assert_close(loss, want)
    assert not st["clipped_low"].any() and not st["clipped_high"].any()


def test_sapo_gradient_is_the_policy_gradient_at_ratio_one_and_a_soft_gate_elsewhere():
    logp = torch.tensor([[0.0, LN(1.5), LN(3.0)]], dtype=torch.float64, requires_grad=True)
    loss, _ = sapo(logp, torch.zeros(1, 3, dtype=torch.float64), torch.tensor([2.0], dtype=torch.float64),
                   torch.ones(1, 3, dtype=torch.bool), sapo_temperature_pos=2.0)
    loss.sum().backward()
    # d/dlogp of -(4/τ)σ(τ(ρ-1))·A = -4σ(1-σ)·ρ·A: -A at ρ = 1, then the gate closes smoothly (no hard cut)
    want = [-4 * _sigmoid(2 * (r - 1)) * (1 - _sigmoid(2 * (r - 1))) * r * 2.0 for r in (1.0, 1.5, 3.0)]
    torch.testing.assert_close(logp.grad, torch.tensor([want], dtype=torch.float64))
    assert logp.grad[0, 0].item() == pytest.approx(-2.0)
    assert -0.5 < logp.grad[0, 2].item() < 0  # far from ρ = 1: damped, yet not cut to 0 as by a clip


def test_sapo_larger_negative_temperature_damps_negative_updates_more():
    logp = torch.tensor([[LN(0.5)]], requires_grad=True)
    grads = []
    for tau_neg in (1.05, 3.0):
        loss, _ = sapo(logp, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1, dtype=torch.bool),
                       sapo_temperature_neg=tau_neg)
        grads.append(abs(torch.autograd.grad(loss.sum(), logp)[0].item()))
    assert grads[1] < grads[0]


# ----------------------------------------------------------------------------- KL: verl's abs and low_var_kl
def test_abs_kl_hand_values():
    # verl kl_penalty "abs": |log π - log π_ref|
    logp = torch.tensor([[LN(0.5), LN(0.25), LN(0.3)]])
    ref = torch.tensor([[LN(0.25), LN(0.5), LN(0.3)]])
    torch.testing.assert_close(KL_ESTIMATORS["abs"](logp, ref), torch.tensor([[LN(2), LN(2), 0.0]]))
    assert kl_k1(logp, ref)[0, 1].item() == pytest.approx(-LN(2))  # k1 there is negative, abs is not


def test_low_var_kl_is_k3_clamped_at_ten_hand_values():
    # verl "low_var_kl": d = ref - logp; clamp(exp(d) - d - 1, -10, 10)
    d = torch.tensor([[1.0, 3.0, -12.0, 0.0]], dtype=torch.float64)
    logp = torch.zeros_like(d, requires_grad=True)
    kl = KL_ESTIMATORS["low_var_kl"](logp, d)
    torch.testing.assert_close(kl.detach(), torch.tensor([[math.e - 2, 10.0, 10.0, 0.0]], dtype=torch.float64))
    # the unclamped k3 (TRL's, and grpolab's "k3") keeps e³ - 4 = 16.09 and 11.000006
    torch.testing.assert_close(kl_k3(logp, d).detach(),
                               torch.tensor([[math.e - 2, math.exp(3) - 4, math.exp(-12) + 11, 0.0]], dtype=torch.float64))
    kl.sum().backward()
    # d/dlogp (exp(d) - d - 1) = 1 - exp(d); no gradient where the clamp acts
    torch.testing.assert_close(logp.grad, torch.tensor([[1 - math.e, 0.0, 0.0, 0.0]], dtype=torch.float64))


@pytest.mark.parametrize("name", ["abs", "low_var_kl"])
def test_new_kl_estimators_are_zero_at_the_reference(name):
    logp = -torch.rand(3, 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(KL_ESTIMATORS[name](logp, logp), torch.zeros(3, 4))


def test_sequence_kl_sums_the_estimate_over_counted_tokens():
    old = torch.tensor([[LN(0.5), LN(0.5), LN(0.9)]], dtype=torch.float64)
    ref = torch.tensor([[LN(0.25), LN(0.5), LN(0.1)]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False]])
    # k1 (verl's default "kl"): (ln .5 - ln .25) + 0; the masked token is left out
    torch.testing.assert_close(sequence_kl(old, ref, mask), torch.tensor([LN(2)], dtype=torch.float64))
    # k3: d = ln(.25/.5) = -ln 2 -> 1/2 + ln 2 - 1
    torch.testing.assert_close(sequence_kl(old, ref, mask, kl_k3), torch.tensor([0.5 + LN(2) - 1], dtype=torch.float64))


# ----------------------------------------------------------------------------- aggregation: token-sum, bnpo
PER_TOK = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [10.0, 20.0, 30.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
MASK = torch.tensor([[True, True, False], [True, False, False], [True, False, False], [True, True, True]])


def _minibatch_loss(mode: str, micros: list[list[int]], per_tok=PER_TOK, mask=MASK) -> torch.Tensor:
    norm = agg_normalizer(mask, mode)
    return sum(aggregate(per_tok[m], mask[m], mode, norm) for m in micros)


def test_token_sum_hand_value_and_microbatch_invariance():
    # verl agg_loss "token-sum": masked_sum(loss_mat, loss_mask), no divisor
    want = torch.tensor(1 + 2 + 4 + 10 + 3.0, dtype=torch.float64)
    for micros in ([[0, 1, 2, 3]], [[0], [1], [2], [3]], [[0, 3], [1, 2]]):
        torch.testing.assert_close(_minibatch_loss("token-sum", micros), want)
    assert not AGGREGATIONS["token-sum"].per_microbatch


def test_bnpo_hand_value_is_trl_mean_of_microbatch_token_means():
    # TRL bnpo, 2 accumulation steps of 2 rows: each (Σ loss·mask) / Σ mask, divided by 2
    micro_means = [(1 + 2 + 4) / 3, (10 + 3) / 4]
    want = torch.tensor(sum(micro_means) / 2, dtype=torch.float64)  # 2.7917
    torch.testing.assert_close(_minibatch_loss("bnpo", [[0, 1], [2, 3]]), want)
    # unlike token-mean over the minibatch (20 / 7 = 2.857), whatever the split
    torch.testing.assert_close(_minibatch_loss("token-mean", [[0, 1], [2, 3]]), torch.tensor(20 / 7, dtype=torch.float64))
    assert AGGREGATIONS["bnpo"].per_microbatch


def test_bnpo_depends_on_the_microbatch_split_and_is_grpo_with_one_row_each():
    whole = _minibatch_loss("bnpo", [[0, 1, 2, 3]])
    torch.testing.assert_close(whole, _minibatch_loss("token-mean", [[0, 1, 2, 3]]))  # one microbatch: token mean
    one_row = _minibatch_loss("bnpo", [[0], [1], [2], [3]])
    # TRL's doc: with per_device_train_batch_size == 1 the loss is the GRPO (sequence-mean) loss
    torch.testing.assert_close(one_row, _minibatch_loss("seq-mean-token-mean", [[0, 1, 2, 3]]))
    assert not torch.allclose(whole, one_row)


def test_bnpo_rows_argument_keeps_the_weight_of_a_microbatch_forwarded_in_part():
    # a caller that drops a microbatch's empty rows (SkipEmptyRows) passes the full row count
    mask = MASK.clone()
    mask[1] = False
    norm = agg_normalizer(mask, "bnpo")
    full = aggregate(PER_TOK[[0, 1]], mask[[0, 1]], "bnpo", norm)
    part = aggregate(PER_TOK[[0]], mask[[0]], "bnpo", norm, rows=2)
    torch.testing.assert_close(part, full)
    assert not torch.allclose(aggregate(PER_TOK[[0]], mask[[0]], "bnpo", norm), full)


# ----------------------------------------------------------------------------- TRL scale_rewards="batch"
def test_batch_std_hand_values():
    r = torch.tensor([[0.0, 1.0, 1.0], [2.0, 2.0, math.nan]], dtype=torch.float64)
    # scored: 0, 1, 1, 2, 2: mean 1.2, Σ(r - mean)² = 2.8, sample std sqrt(2.8 / 4)
    sd = math.sqrt(2.8 / 4)
    torch.testing.assert_close(batch_std(r), torch.tensor([[sd]], dtype=torch.float64))
    torch.testing.assert_close(group_std(r, "batch"), torch.tensor([[sd], [sd]], dtype=torch.float64))
    adv = make_advantage_fn("group_norm", "batch", eps=0.0)(r)
    # centred by the group mean (2/3 in group 0), scaled by the batch std; equal / NaN rows -> 0
    want = torch.tensor([[-2 / 3 / sd, 1 / 3 / sd, 1 / 3 / sd], [0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(adv, want)
    torch.testing.assert_close(group_normalize(r, "batch", 0.0), want)
    # the group std would scale group 0 by sqrt(1/3) instead
    assert not torch.allclose(make_advantage_fn("group_norm", "sample", eps=0.0)(r), want)


def test_batch_std_is_torch_sample_std_of_the_scored_rewards():
    g = torch.Generator().manual_seed(3)
    r = torch.randn(5, 4, generator=g, dtype=torch.float64) * 3 + 7
    r[1, 2] = math.nan
    torch.testing.assert_close(batch_std(r).squeeze(), r[~torch.isnan(r)].std())


class _ThreadRanks:
    """World-size-`n` all-reduce(sum) among threads, one per simulated rank."""

    def __init__(self, n: int):
        self.barrier, self.slots = threading.Barrier(n, timeout=60), [None] * n  # a failing rank breaks it, no hang

    def reduce_for(self, rank: int):
        def reduce(x: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = x
            self.barrier.wait()
            total = sum(self.slots[1:], self.slots[0])
            self.barrier.wait()  # every rank has read before any writes again
            return total
        return reduce


def _on_ranks(r: torch.Tensor, world: int, reduce: bool) -> torch.Tensor:
    """batch_normalize of each rank's groups (contiguous shares), in threads; concatenated."""
    ranks, out = _ThreadRanks(world), [None] * world
    shards = r.chunk(world)

    def run(rank):
        fn = make_advantage_fn("group_norm", "batch")
        out[rank] = fn(shards[rank], ranks.reduce_for(rank)) if reduce else fn(shards[rank])

    threads = [threading.Thread(target=run, args=(k,)) for k in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return torch.cat(out)


def test_batch_scaling_is_the_same_whatever_the_world_size():
    g = torch.Generator().manual_seed(4)
    r = torch.randn(4, 3, generator=g, dtype=torch.float64)
    r[0] *= 10  # the shards' own stds differ from the batch's
    r[3, 1] = math.nan
    one = make_advantage_fn("group_norm", "batch")(r)
    for world in (2, 4):
        torch.testing.assert_close(_on_ranks(r, world, reduce=True), one)
    # without the reduction each rank would scale by its own shard's std (the test could fail)
    assert not torch.allclose(_on_ranks(r, 2, reduce=False), one)


def test_group_local_estimators_ignore_the_reduction():
    r = torch.tensor([[0.0, 1.0, 3.0]])
    never = lambda x: pytest.fail("a group-local estimator must not reduce")
    for kind in ADVANTAGE_ESTIMATORS:
        for std in ("population", "sample", "none"):
            fn = make_advantage_fn(kind, std)
            torch.testing.assert_close(fn(r, never), fn(r))
    assert STD_MODES["batch"].batch and not STD_MODES["sample"].batch
    torch.testing.assert_close(batch_normalize(r, 0.0), make_advantage_fn("group_norm", "batch", 0.0)(r))


# ----------------------------------------------------------------------------- TRL normalize_then_sum
def test_normalize_then_sum_hand_values():
    nan = math.nan
    scores = {"a": torch.tensor([1.0, 0.0, 1.0, 1.0, nan, 3.0]), "b": torch.tensor([0.0, 2.0, nan, nan, nan, 1.0])}
    weights = {"a": 1.0, "b": 0.5}
    # group 0: a -> (±0.5) / sample std 1/√2 = ±1/√2; b -> (∓1) / √2 = ∓1/√2; sum 1/√2 - 0.5/√2
    # group 1: a equal -> 0, b abstained -> 0 (the rows still count: a scored them)
    # group 2: row 4 abstained everywhere -> NaN; row 5 alone in each function -> 0
    s = 0.5 / math.sqrt(2)
    got = combine(scores, weights, "normalize_then_sum", group_size=2, eps=0.0)
    torch.testing.assert_close(got, torch.tensor([s, -s, 0.0, 0.0, nan, 0.0]), equal_nan=True)
    # the default sums first (the advantage estimator normalizes the sum)
    torch.testing.assert_close(combine(scores, weights), torch.tensor([1.0, 1.0, 1.0, 1.0, nan, 3.5]), equal_nan=True)
    with pytest.raises(ValueError, match="normalize_then_sum"):
        combine(scores, weights, "sum")


def test_normalize_then_sum_weighs_rewards_of_different_scales_alike():
    # a 0/1 accuracy and a reward of scale 100: summed first, the large one decides the ranking;
    # normalized first, both count alike
    acc = torch.tensor([1.0, 0.0, 1.0, 0.0])
    big = torch.tensor([0.0, 100.0, 10.0, 20.0])
    summed = combine({"acc": acc, "big": big}, {"acc": 1.0, "big": 1.0})
    norm = combine({"acc": acc, "big": big}, {"acc": 1.0, "big": 1.0}, "normalize_then_sum", group_size=2, eps=0.0)
    assert summed[0] < summed[1]  # the correct row loses on the raw sum
    torch.testing.assert_close(norm, torch.tensor([0.0, 0.0, 0.0, 0.0]))  # acc and big cancel out in each group


# ----------------------------------------------------------------------------- registries
def test_the_new_entries_are_registered_under_the_peers_names():
    assert POLICY_LOSSES["cispo"] is cispo and POLICY_LOSSES["sapo"] is sapo
    assert {"abs", "low_var_kl"} <= set(KL_ESTIMATORS)
    assert {"token-sum", "bnpo"} <= set(AGGREGATIONS)
    assert STD_MODES["batch"].doc


@pytest.mark.parametrize("name", ["cispo", "sapo"])
def test_new_policy_losses_ignore_masked_positions_and_keep_shapes(name):
    g = torch.Generator().manual_seed(5)
    logp = -torch.rand(3, 4, generator=g)
    old = logp + 0.3 * torch.randn(3, 4, generator=g)
    mask = torch.rand(3, 4, generator=g) > 0.4
    per_tok, stats = POLICY_LOSSES[name](logp, old, torch.randn(3, generator=g), mask)
    assert per_tok.shape == (3, 4) and all(v.shape == (3, 4) for v in stats.values())
    noisy = torch.where(mask, per_tok, per_tok + 123.0)
    norm = agg_normalizer(mask, "token-mean")
    torch.testing.assert_close(aggregate(noisy, mask, "token-mean", norm), aggregate(per_tok, mask, "token-mean", norm))


def test_kl_reward_penalty_per_sequence_and_per_token():
    from grpolab.algo.kl import kl_reward_penalty

    g = torch.Generator().manual_seed(0)
    old, ref = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    mask = torch.tensor([[True] * 5, [True, True, False, False, False], [False] * 5])
    per_seq, per_tok = kl_reward_penalty(old, ref, mask, 0.5, kl_k3)
    torch.testing.assert_close(per_seq, 0.5 * sequence_kl(old, ref, mask, kl_k3))
    torch.testing.assert_close(per_tok.sum(-1), per_seq)
    assert per_tok.shape == (3, 5) and bool((per_tok[~mask] == 0).all())
