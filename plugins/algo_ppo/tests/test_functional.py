"""PPO math against hand-computed values: GAE over a hole, the clipped value loss, KL control."""

import math

import pytest
import torch
from hybridrl_algo_ppo import functional as PF


def close(actual, expected, **tol):
    tol = tol or {"rtol": 1e-6, "atol": 1e-7}
    torch.testing.assert_close(actual.float(), torch.tensor(expected, dtype=torch.float32), **tol)


def whiten(xs):
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
    return [(x - mean) / math.sqrt(var + 1e-8) for x in xs]


def test_gae_skips_a_hole_and_whitens_over_the_mask():
    # row 0: tokens 0 and 2 are the policy's, token 1 an observation (hole); score 1 at t=2
    # row 1: two tokens and padding; score 2 at t=1. Values on masked positions are junk.
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = torch.tensor([[0.5, 9.0, 0.8], [1.0, 1.5, 7.0]])
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])
    adv, returns = PF.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # row 0: t=2: delta = 1 - 0.8 = 0.2, A = 0.2; t=1 (hole): V_next = 0.8 and A_next = 0.2 carried;
    #        t=0: delta = 0 + 0.9 * 0.8 - 0.5 = 0.22, A = 0.22 + 0.9 * 0.8 * 0.2 = 0.364
    # row 1: t=1: delta = 2 - 1.5 = 0.5, A = 0.5; t=0: delta = 0.9 * 1.5 - 1 = 0.35, A = 0.35 + 0.72 * 0.5 = 0.71
    raw = [0.364, 0.2, 0.71, 0.5]
    close(returns[0, [0, 2]], [0.364 + 0.5, 0.2 + 0.8])
    close(returns[1, [0, 1]], [0.71 + 1.0, 0.5 + 1.5])
    w = whiten(raw)
    close(adv, [[w[0], 0.0, w[1]], [w[2], w[3], 0.0]], rtol=1e-5, atol=1e-6)


def test_gae_with_gamma_lambda_one_is_return_minus_value():
    rewards = torch.tensor([[0.0, 0.0, 3.0], [0.0, 1.0, 0.0]])
    values = torch.tensor([[1.0, 2.0, 0.5], [0.0, 0.25, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    _, returns = PF.gae(rewards, values, mask, 1.0, 1.0)
    close(returns * mask, [[3.0, 3.0, 3.0], [1.0, 1.0, 0.0]])  # every token's return is the score


def test_clipped_value_loss_hand_computed():
    vpreds = torch.tensor([[1.0, 2.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.0, 1.8, 0.0]])
    returns = torch.tensor([[1.2, 1.0, 5.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, clipfrac = PF.value_loss(vpreds, returns, old, mask, cliprange_value=0.5)
    # token 0: (1 - 1.2)^2 = 0.04, clipped v = 0.5: (0.5 - 1.2)^2 = 0.49 -> 0.49 (the clipped term)
    # token 1: v = 2 is inside [1.3, 2.3]: both (2 - 1)^2 = 1 -> 1; token 2 masked
    assert loss.item() == pytest.approx(0.5 * (0.49 + 1.0) / 2)
    assert clipfrac.item() == pytest.approx(0.5)
    loss.backward()
    # the clipped term does not depend on v; token 1: 0.5 * 1/2 * 2 (v - R) = 0.5
    close(vpreds.grad, [[0.0, 0.5, 0.0]])


def test_value_loss_aggregation_modes():
    vpreds = torch.tensor([[1.0, 0.0], [2.0, 2.0]])
    returns = torch.zeros(2, 2)
    mask = torch.tensor([[1, 0], [1, 1]])
    # squared errors 1 | 4, 4 (no clipping: old values equal the predictions)
    cases = {"token-mean": 9 / 3, "seq-mean-token-sum": (1 + 8) / 2, "seq-mean-token-mean": (1 + 4) / 2}
    for mode, expected in cases.items():
        loss, _ = PF.value_loss(vpreds, returns, vpreds, mask, 0.5, mode)
        assert loss.item() == pytest.approx(0.5 * expected), mode


def test_explained_variance():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0, 100.0]])
    returns = torch.tensor([[1.0, 2.0, 3.0, 5.0, -100.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    # Var(R - V) = Var(0, 0, 0, 1) = 0.25; Var(R) = Var(1, 2, 3, 5) = 8.75 / 3
    assert PF.explained_variance(values, returns, mask) == pytest.approx(1 - 0.25 / (8.75 / 3 + 1e-5))
    assert PF.explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert PF.explained_variance(values, returns, torch.tensor([[1, 0, 0, 0, 0]])) == 0.0


def test_kl_penalized_rewards():
    scores = torch.tensor([1.0, 0.0])
    old = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -2.0, -2.0], [-1.2, -1.0, -0.2]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    rewards, row_kl = PF.kl_penalized_rewards(scores, old, ref, mask, beta=0.1, kind="k1")
    # k1 = old - ref: row 0 [0.5, 0, (-1 masked)], row 1 [0.2, (0 hole), -0.8]; score at the last token
    close(rewards, [[-0.05, 1.0, 0.0], [-0.02, 0.0, 0.08]])
    close(row_kl, [(0.5 + 0) / 2, (0.2 - 0.8) / 2])


@pytest.mark.parametrize(
    "current, expected",
    [(0.15, 0.1 * (1 + 0.2 * 0.1)), (0.09, 0.1 * (1 - 0.1 * 0.1)), (10.0, 0.1 * (1 + 0.2 * 0.1))],
)
def test_adaptive_kl_coef(current, expected):
    # error = clip(KL / 0.1 - 1, -0.2, 0.2); 100 responses over a horizon of 1000
    assert PF.adaptive_kl_coef(0.1, current, 0.1, 1000, 100) == pytest.approx(expected)
