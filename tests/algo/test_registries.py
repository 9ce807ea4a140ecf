"""The registries of grpolab.algo: their keys are exactly what config validation accepts, and each
entry computes bit for bit what the former string-branch implementation computed."""

import math

import pytest
import torch

from grpolab import config as C
from grpolab.config import validation
from grpolab.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    STD_MODES,
    AdvantageEstimator,
    group_normalize,
    group_std,
    leave_one_out,
    make_advantage_fn,
    raw_rewards,
    relu_rewards,
)
from grpolab.algo.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    LOG_RATIO_CLAMP,
    POLICY_LOSSES,
    Aggregation,
    agg_normalizer,
    aggregate,
    kl_penalty,
    sft_nll,
)
from grpolab.algo.optim import LR_SCHEDULES, lr_lambda

# dotted field -> (registry keys, one value that is not a key)
REGISTRY_FIELDS = {
    "loss.policy_loss": (tuple(POLICY_LOSSES) + ("sft",), "ppo"),
    "loss.advantage": (tuple(ADVANTAGE_ESTIMATORS), "vtrace"),
    "loss.std": (tuple(STD_MODES), "pop"),
    "loss.kl_estimator": (tuple(KL_ESTIMATORS), "k4"),
    "loss.loss_agg": (tuple(AGGREGATIONS), "token-max"),
    "train.lr_schedule": (tuple(LR_SCHEDULES), "step"),
}


@pytest.mark.parametrize("field", sorted(REGISTRY_FIELDS))
def test_validation_accepts_exactly_the_registry_keys(field):
    keys, bad = REGISTRY_FIELDS[field]
    assert validation.field_choices()[field] == keys
    assert tuple(validation.registry_choices()[field]) == keys
    for key in keys:
        cfg = C.from_preset("grpo", [f"{field}={key}"])
        assert validation.get_field(cfg, field) == key
    with pytest.raises(C.ConfigError, match=f"{field}='{bad}' is not one of {', '.join(keys)}"):
        C.from_preset("grpo", [f"{field}={bad}"])


def test_entries_have_the_documented_types():
    assert all(isinstance(a, Aggregation) for a in AGGREGATIONS.values())
    assert all(isinstance(a, AdvantageEstimator) for a in ADVANTAGE_ESTIMATORS.values())
    assert all(callable(k) for k in KL_ESTIMATORS.values())
    # every entry has a description for the config reference
    for field in REGISTRY_FIELDS:
        assert all(validation.registry_choices()[field].values()), field


def test_unknown_names_are_value_errors_naming_the_choices():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=r"kl_estimator must be one of \('k1', 'k2', 'k3'"):
        kl_penalty(x, x, "k4")
    with pytest.raises(ValueError, match="loss_agg must be one of"):
        agg_normalizer(x.bool(), "token-max")
    with pytest.raises(ValueError, match="loss_agg must be one of"):
        aggregate(x, x.bool(), "token-max", torch.tensor(1.0))
    with pytest.raises(ValueError, match="advantage must be one of"):
        make_advantage_fn("vtrace")
    with pytest.raises(ValueError, match="std must be one of"):
        make_advantage_fn("group_norm", std="pop")
    with pytest.raises(ValueError, match="lr_schedule must be one of"):
        lr_lambda("step", 0, 10)
    with pytest.raises(ValueError, match="needs a std mode that scales"):
        group_std(torch.zeros(1, 2), "none")


# ----------------------------------------------------------------------------- the former formulas
def _old_kl(logp, ref_logp, estimator):
    d = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return {"k1": lambda: -d, "k2": lambda: 0.5 * d * d, "k3": lambda: torch.exp(d) - d - 1.0}[estimator]()


def _old_normalizer(loss_mask, mode, constant_len=None):
    m = loss_mask.bool()
    if mode == "token-mean":
        n = m.sum()
    elif mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        n = m.any(-1).sum()
    else:
        n = torch.tensor(m.shape[0] * constant_len)
    return n.to(torch.float32)


def _old_aggregate(per_token, loss_mask, mode, normalizer):
    m = loss_mask.to(per_token.dtype)
    if mode == "seq-mean-token-mean":
        total = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).sum()
    else:
        total = (per_token * m).sum()
    return total / normalizer.clamp(min=1)


def _old_group_normalize(rewards, std, eps):
    valid = ~torch.isnan(rewards)
    filled = torch.where(valid, rewards, torch.zeros_like(rewards))
    count = valid.sum(dim=1, keepdim=True).to(rewards.dtype)
    mean = filled.sum(dim=1, keepdim=True) / count.clamp(min=1)
    centred = filled - mean
    if std != "none":
        sq = torch.where(valid, (filled - mean) ** 2, torch.zeros_like(filled)).sum(dim=1, keepdim=True)
        denom = count if std == "population" else count - 1
        var = sq / denom.clamp(min=1)
        sd = torch.where(count >= 2, var.sqrt(), torch.zeros_like(var))
        centred = torch.where(sd > 0, centred / (sd + eps), torch.zeros_like(centred))
    return torch.where(valid & (count >= 2), centred, torch.zeros_like(centred))


def _old_lr_lambda(schedule, warmup, total):
    def f(i):
        if warmup and i < warmup:
            return (i + 1) / warmup
        if schedule == "constant":
            return 1.0
        frac = min(1.0, (i - warmup) / max(1, total - warmup))
        return 0.5 * (1 + math.cos(math.pi * frac)) if schedule == "cosine" else 1.0 - frac

    return f


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a, b), (a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_kl_estimators_are_bit_identical_to_the_former_branches(dtype):
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(6, 9, generator=g) * 30).to(dtype)  # includes log-ratios past the clamp
    ref = (-torch.rand(6, 9, generator=g) * 30).to(dtype)
    for name in ("k1", "k2", "k3"):  # the entries that replaced the former branches
        fn = KL_ESTIMATORS[name]
        _same(fn(logp, ref), _old_kl(logp, ref, name))
        _same(kl_penalty(logp, ref, name), _old_kl(logp, ref, name))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_aggregations_are_bit_identical_to_the_former_branches(dtype):
    g = torch.Generator().manual_seed(1)
    per_tok = torch.randn(8, 7, generator=g).to(dtype)
    mask = torch.rand(8, 7, generator=g) > 0.35
    mask[3] = False  # a sequence without counted tokens
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant"):  # the former branches
        agg = AGGREGATIONS[mode]
        n_old = _old_normalizer(mask, mode, 7)
        _same(agg.normalizer(mask, 7), n_old)
        _same(agg_normalizer(mask, mode, 7), n_old)
        for rows in ([0, 1, 2], [3, 4, 5, 6, 7]):
            _same(agg.aggregate(per_tok[rows], mask[rows], n_old), _old_aggregate(per_tok[rows], mask[rows], mode, n_old))
            _same(aggregate(per_tok[rows], mask[rows], mode, n_old), _old_aggregate(per_tok[rows], mask[rows], mode, n_old))
    logp = -torch.rand(8, 7, generator=g)
    _same(sft_nll(logp, mask), _old_aggregate(-logp, mask, "seq-mean-token-mean", _old_normalizer(mask, "seq-mean-token-mean")))


def test_constant_aggregation_needs_a_positive_length():
    with pytest.raises(ValueError, match="positive constant_len"):
        AGGREGATIONS["constant"].normalizer(torch.ones(2, 3, dtype=torch.bool), None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_advantage_estimators_are_bit_identical_to_the_former_table(dtype):
    g = torch.Generator().manual_seed(2)
    r = torch.randn(6, 5, generator=g).to(dtype)
    r[0, 1] = math.nan
    r[1] = 0.5  # equal rewards
    r[2, 1:] = math.nan  # one scored row
    old = {"rloo": leave_one_out, "reinforce": raw_rewards, "relu": relu_rewards}
    for std in ("population", "sample", "none"):  # the former modes
        for eps in (1e-6, 0.0):
            _same(make_advantage_fn("group_norm", std, eps)(r), _old_group_normalize(r, std, eps))
            _same(group_normalize(r, std, eps), _old_group_normalize(r, std, eps))
            for kind, fn in old.items():
                _same(make_advantage_fn(kind, std, eps)(r), fn(r))
    assert ADVANTAGE_ESTIMATORS["group_norm"].needs_group and ADVANTAGE_ESTIMATORS["rloo"].needs_group
    assert not ADVANTAGE_ESTIMATORS["reinforce"].needs_group and not ADVANTAGE_ESTIMATORS["relu"].needs_group


def test_lr_schedules_are_identical_to_the_former_branches():
    for schedule in ("constant", "cosine", "linear"):  # the former branches
        for warmup, total in ((0, 10), (3, 10), (10, 10), (5, 1)):
            new, old = lr_lambda(schedule, warmup, total), _old_lr_lambda(schedule, warmup, total)
            assert [new(i) for i in range(total + 3)] == [old(i) for i in range(total + 3)]
