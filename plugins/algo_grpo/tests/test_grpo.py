"""GRPO's group advantage and loss against hand-computed values."""

import math

import pytest
import torch
from hybridrl_algo_grpo.functional import group_advantages

from hybridrl.batch import Batch


def test_group_advantages_hand_computed():
    scores = torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0])
    groups = torch.tensor([0, 0, 0, 1, 1])
    mask = torch.tensor([[1, 1, 0]] * 5)
    adv = group_advantages(scores, mask, groups, eps=1e-6)
    # group 0: mean 1/3, unbiased std sqrt(1/3); group 1: mean 3, std sqrt(2)
    s0 = math.sqrt(1 / 3)
    expected = [
        (1 - 1 / 3) / (s0 + 1e-6),
        (-1 / 3) / (s0 + 1e-6),
        (-1 / 3) / (s0 + 1e-6),
        -1 / (math.sqrt(2) + 1e-6),
        1 / (math.sqrt(2) + 1e-6),
    ]
    assert adv[:, 0].tolist() == pytest.approx(expected, rel=1e-5)
    assert adv[:, 1].tolist() == pytest.approx(expected, rel=1e-5)
    assert adv[:, 2].tolist() == [0.0] * 5  # masked


def test_singleton_group_keeps_its_score():
    adv = group_advantages(torch.tensor([0.7, 1.0, 3.0]), torch.ones(3, 1), torch.tensor([0, 1, 1]), eps=1e-6)
    assert adv[0, 0].item() == pytest.approx(0.7 / (1 + 1e-6))  # mean 0, std 1


def test_dr_grpo_does_not_divide_by_std():
    adv = group_advantages(torch.tensor([1.0, 3.0]), torch.ones(2, 1), torch.tensor([0, 0]), norm_std=False)
    assert adv[:, 0].tolist() == pytest.approx([-1.0, 1.0])


def test_equal_rewards_give_zero_advantage():
    adv = group_advantages(torch.ones(4), torch.ones(4, 2), torch.zeros(4, dtype=torch.long))
    assert adv.abs().max().item() == 0.0


def test_grpo_loss_adds_kl_term():
    from hybridrl import plugins

    GRPO = plugins.lookup("algorithm", "grpo")
    algo = GRPO(GRPO.Options(kl_coef=0.5, kl_kind="k1"), ctx=None)
    assert algo.needs_reference
    b = Batch()
    b["response_mask"] = torch.ones(1, 2)
    b["old_logprobs"] = torch.zeros(1, 2)
    b["ref_logprobs"] = torch.tensor([[-1.0, -1.0]])
    b["advantages"] = torch.tensor([[1.0, 1.0]])
    loss, m = algo.loss(b, torch.zeros(1, 2), torch.zeros(1, 2))
    # pg loss: -A * ratio = -1 per token; k1 kl = 0 - (-1) = 1 per token
    assert loss.item() == pytest.approx(-1 + 0.5 * 1)
    assert m["actor/kl"] == pytest.approx(1.0)


def test_no_reference_without_kl():
    from hybridrl import plugins

    GRPO = plugins.lookup("algorithm", "grpo")
    assert not GRPO(GRPO.Options(), ctx=None).needs_reference
