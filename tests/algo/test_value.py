"""PPO's value function (algo/value.py) on tiny tensors: GAE on hand-computed values of verl's
compute_gae_advantage_return, whitening, the clipped value loss of verl's compute_value_loss, token
rewards with a per-token KL, explained variance; and the per-token advantages of the objective."""

import pytest
import torch

from grpolab.algo.losses import POLICY_LOSSES
from grpolab.algo.value import (
    explained_variance,
    gae,
    last_token_rewards,
    masked_whiten,
    token_rewards,
    value_loss,
)
from grpolab.grpo.objective import per_token_advantages

# row 0: three counted tokens, reward 1 on the last; row 1: two counted tokens, reward -1, one pad
MASK = torch.tensor([[True, True, True], [True, True, False]])
REWARDS = torch.tensor([[0.0, 0.0, 1.0], [0.0, -1.0, 0.0]])
VALUES = torch.tensor([[0.5, 0.2, 0.4], [0.1, -0.3, 9.0]])  # 9.0 sits on the pad: never read


def _verl_gae(rewards, values, mask, gamma, lam):
    """verl's definition written out per element: δ_t = r_t + γ·V_next - V_t, A_t = δ_t + γλ·A_next,
    V_next and A_next carried over positions outside the mask."""
    n, width = values.shape
    adv = torch.zeros(n, width, dtype=torch.float64)
    for i in range(n):
        next_v = next_a = 0.0
        for t in reversed(range(width)):
            a = float(rewards[i, t]) + gamma * next_v - float(values[i, t]) + gamma * lam * next_a
            if mask[i, t]:
                next_v, next_a = float(values[i, t]), a
                adv[i, t] = a
    return adv


@pytest.mark.parametrize("gamma, lam, want", [
    # γ = λ = 1: A_t = R - V_t (row 0: 1 - V, row 1: -1 - V)
    (1.0, 1.0, [[0.5, 0.8, 0.6], [-1.1, -0.7, 0.0]]),
    # row 0: δ = (-0.3, 0.2, 0.6); A2 = 0.6, A1 = 0.2 + 0.95·0.6 = 0.77, A0 = -0.3 + 0.95·0.77 = 0.4315
    # row 1: δ = (-0.3 - 0.1, -1 + 0.3) = (-0.4, -0.7); A1 = -0.7, A0 = -0.4 + 0.95·(-0.7) = -1.065
    (1.0, 0.95, [[0.4315, 0.77, 0.6], [-1.065, -0.7, 0.0]]),
    # λ = 1: A_t = Σ γ^k r_{t+k} - V_t: row 0: 0.95² - 0.5, 0.95 - 0.2, 1 - 0.4; row 1: -0.95 - 0.1, -1 + 0.3
    (0.95, 1.0, [[0.4025, 0.75, 0.6], [-1.05, -0.7, 0.0]]),
    # row 0: δ = (0.95·0.2 - 0.5, 0.95·0.4 - 0.2, 0.6) = (-0.31, 0.18, 0.6); A1 = 0.18 + 0.9025·0.6 = 0.7215,
    # A0 = -0.31 + 0.9025·0.7215 = 0.34115...; row 1: δ = (0.95·(-0.3) - 0.1, -0.7); A0 = -0.385 - 0.9025·0.7
    (0.95, 0.95, [[-0.31 + 0.9025 * 0.7215, 0.7215, 0.6], [-0.385 - 0.9025 * 0.7, -0.7, 0.0]]),
])
def test_gae_on_hand_values_of_verls_definition(gamma, lam, want):
    adv, ret = gae(REWARDS, VALUES, MASK, gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(want))
    torch.testing.assert_close(adv.double(), _verl_gae(REWARDS, VALUES, MASK, gamma, lam).to(adv).double())
    torch.testing.assert_close(ret, torch.where(MASK, adv + VALUES, torch.zeros_like(adv)))  # R = A + V; 0 on pads


def test_gae_skips_positions_outside_the_mask_as_verl_does():
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(4, 6, generator=g).double(), torch.randn(4, 6, generator=g).double()
    mask = torch.rand(4, 6, generator=g) > 0.3  # holes too, not only a prefix
    for gamma, lam in ((1.0, 1.0), (0.9, 0.8)):
        adv, _ = gae(rewards, values, mask, gamma, lam)
        torch.testing.assert_close(adv, _verl_gae(rewards, values, mask, gamma, lam))
    # a value on a skipped position changes nothing
    bumped = values.masked_fill(~mask, 50.0)
    torch.testing.assert_close(gae(rewards, bumped, mask, 0.9, 0.8)[0], gae(rewards, values, mask, 0.9, 0.8)[0])


def test_last_token_and_per_token_kl_rewards():
    mask = torch.tensor([[True, True, True, False], [True, False, False, False], [False] * 4])
    out = last_token_rewards(torch.tensor([2.0, -1.0, 5.0]), mask)
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, 2.0, 0.0], [-1.0, 0, 0, 0], [0.0] * 4]))
    kl = torch.tensor([[0.1, 0.2, 0.3, 7.0], [0.5, 7.0, 7.0, 7.0], [7.0] * 4])
    r = token_rewards(torch.tensor([2.0, -1.0, 5.0]), mask, 0.5 * kl)
    torch.testing.assert_close(r, torch.tensor([[-0.05, -0.1, 2.0 - 0.15, 0.0], [-1.25, 0, 0, 0], [0.0] * 4]))
    torch.testing.assert_close(token_rewards(torch.tensor([2.0, -1.0, 5.0]), mask, None), out)


def test_masked_whiten_hand_values():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[True, True, True, False]])
    # mean 2, Bessel variance (1 + 0 + 1) / 2 = 1 -> (-1, 0, 1); the pad is 0
    torch.testing.assert_close(masked_whiten(x, mask), torch.tensor([[-1.0, 0.0, 1.0, 0.0]]))
    torch.testing.assert_close(masked_whiten(torch.full((1, 3), 4.0), torch.ones(1, 3, dtype=torch.bool)),
                               torch.zeros(1, 3))  # equal entries: 0, not NaN


def test_value_loss_hand_values_and_clipping():
    v = torch.tensor([[1.0, 0.0, 0.9]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.5]])
    ret = torch.tensor([[0.6, 1.0, 1.2]])
    per_tok, st = value_loss(v, old, ret, clip=0.2)
    # clip(V) = (0.7, 0.3, 0.7); (V-R)² = (0.16, 1.0, 0.09); (clip(V)-R)² = (0.01, 0.49, 0.25)
    torch.testing.assert_close(per_tok, torch.tensor([[0.08, 0.5, 0.125]]))
    assert st["clipped"].tolist() == [[False, False, True]]
    per_tok.sum().backward()
    # d/dV 0.5(V-R)² = V - R where the plain term wins; 0 where the clipped term (V outside V_old ± 0.2) wins
    torch.testing.assert_close(v.grad, torch.tensor([[0.4, -1.0, 0.0]]))
    plain, st = value_loss(v.detach(), old, ret, clip=None)
    torch.testing.assert_close(plain, torch.tensor([[0.08, 0.5, 0.045]]))
    assert not st["clipped"].any()


def test_explained_variance():
    ret = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    mask = torch.tensor([[True, True, True, False]])
    torch.testing.assert_close(explained_variance(ret, ret, mask), torch.tensor(1.0))
    torch.testing.assert_close(explained_variance(torch.full_like(ret, 2.0), ret, mask), torch.tensor(0.0))
    torch.testing.assert_close(explained_variance(torch.zeros(1, 4), torch.ones(1, 4), mask.bool()),
                               torch.tensor(float("nan")), equal_nan=True)


@pytest.mark.parametrize("name", ["clipped", "weighted_nll", "cispo", "sapo"])
def test_per_token_advantages_equal_the_token_level_loss(name):
    """A per-token advantage equal along each row gives exactly the loss of the row advantage, and
    the gradient follows each token's own advantage."""
    g = torch.Generator().manual_seed(3)
    logp = (-torch.rand(3, 4, generator=g)).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(3, 4, generator=g)
    mask = torch.rand(3, 4, generator=g) > 0.2
    adv = torch.randn(3, generator=g)
    fn = POLICY_LOSSES[name]
    want, want_st = fn(logp, old, adv, mask, 0.2, 0.2, 3.0)
    got, got_st = per_token_advantages(fn)(logp, old, adv[:, None].expand(3, 4), mask, 0.2, 0.2, 3.0)
    torch.testing.assert_close(got, want)
    assert got_st.keys() == want_st.keys() and all(torch.equal(got_st[k], want_st[k]) for k in want_st)
    # a token's loss reads its own advantage: change one token's, only that token's loss changes
    token_adv = adv[:, None].expand(3, 4).clone()
    token_adv[1, 2] += 1.0
    other, _ = per_token_advantages(fn)(logp, old, token_adv, mask, 0.2, 0.2, 3.0)
    changed = (other != got)
    assert changed[1, 2] and changed.sum() == 1
