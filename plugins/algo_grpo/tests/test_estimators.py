"""Critic-free advantage estimators, DAPO pieces and GSPO against hand-computed values.

Masks with a hole in the middle (an observation token inside a response) and groups of one
response are in every estimator's test.
"""

import math

import pytest
import torch
from hybridrl_algo_grpo.functional import (
    group_advantages,
    gspo_policy_loss,
    overlong_penalty,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    varied_groups,
)

from hybridrl import functional as F


def close(actual, expected):
    torch.testing.assert_close(actual.float(), torch.tensor(expected, dtype=torch.float32), rtol=1e-6, atol=1e-7)


def whiten(xs):
    """Hand whitening of a list: (x - mean) / sqrt(unbiased var + 1e-8)."""
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
    return [(x - mean) / math.sqrt(var + 1e-8) for x in xs]


# -- shared helpers in hybridrl.functional ---------------------------------------------------


def test_outcome_token_rewards_put_the_score_on_the_last_unmasked_token():
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    out = F.outcome_token_rewards(torch.tensor([2.0, 3.0, 9.0]), mask)
    assert out.tolist() == [[0, 2, 0, 0], [0, 0, 3, 0], [0, 0, 0, 0]]  # an empty response gets nothing


def test_discounted_returns_carry_over_a_hole():
    rewards = torch.tensor([[0.0, 5.0, 0.0, 2.0]])  # the 5 sits on the masked hole: ignored
    mask = torch.tensor([[1, 0, 1, 1]])
    # t=3: 2; t=2: 0 + 0.5 * 2 = 1; t=1 hole: carried (return 0 there); t=0: 0 + 0.5 * 1 = 0.5
    assert F.discounted_returns(rewards, mask, 0.5).tolist() == [[0.5, 0.0, 1.0, 2.0]]


def test_group_stats_singleton_has_mean_0_std_1():
    mean, std, n = F.group_stats(torch.tensor([4.0, 1.0, 3.0]), torch.tensor([7, 2, 2]))
    assert mean.tolist() == [0.0, 2.0, 2.0]
    assert std.tolist() == pytest.approx([1.0, math.sqrt(2), math.sqrt(2)])
    assert n.tolist() == [1, 2, 2]


# -- estimators ------------------------------------------------------------------------------


def test_grpo_zeroes_the_hole_and_keeps_singletons():
    mask = torch.tensor([[1, 0, 1], [1, 1, 0], [1, 1, 1]])
    adv = group_advantages(torch.tensor([1.0, 3.0, 0.5]), mask, torch.tensor([0, 0, 1]), eps=1e-6)
    a = 1 / (math.sqrt(2) + 1e-6)  # group 0: mean 2, std sqrt(2)
    close(adv, [[-a, 0, -a], [a, a, 0], [0.5 / (1 + 1e-6)] * 3])


def test_rloo_subtracts_the_mean_of_the_others():
    scores = torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0, 5.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    mask = torch.tensor([[1, 0, 1]] * 6)  # a hole at t=1
    adv = rloo_advantages(scores, mask, groups)
    # 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5; 2 - 4 = -2; 4 - 2 = 2; singleton: its score
    expected = [1.0, -0.5, -0.5, -2.0, 2.0, 5.0]
    assert adv[:, 0].tolist() == pytest.approx(expected)
    assert adv[:, 2].tolist() == pytest.approx(expected)
    assert adv[:, 1].tolist() == [0.0] * 6


def test_reinforce_pp_discounted_returns_whitened_over_the_batch():
    scores = torch.tensor([1.0, 2.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])  # row 1 has a hole at t=1
    adv, returns = reinforce_pp_advantages(scores, mask, gamma=0.5)
    # row 0: reward 1 at t=1 -> returns [0.5, 1, 0]; row 1: reward 2 at t=2, carried over the
    # hole -> [1, 0, 2] (verl's reset-at-mask would give row 1 t=0 a return of 0)
    assert returns.tolist() == [[0.5, 1.0, 0.0], [1.0, 0.0, 2.0]]
    w = whiten([0.5, 1.0, 1.0, 2.0])
    close(adv, [[w[0], w[1], 0.0], [w[2], 0.0, w[3]]])


def test_reinforce_pp_baseline_subtracts_group_mean_then_whitens():
    scores = torch.tensor([1.0, 0.0, 3.0])
    groups = torch.tensor([0, 0, 1])  # the last response is alone: its mean is 0
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    adv = reinforce_pp_baseline_advantages(scores, mask, groups)
    w = whiten([0.5, 0.5, -0.5, 3.0, 3.0])
    close(adv, [[w[0], w[1]], [w[2], 0.0], [w[3], w[4]]])


def test_whitening_over_ranks_uses_the_global_statistics():
    """Under torchrun each rank holds half the batch; with ``mean_var`` giving the statistics of
    the whole batch (what hybridrl.distributed.masked_mean_var computes over the ranks), each
    half gets exactly its rows of the one-process result."""
    scores = torch.tensor([1.0, 0.0, 3.0, 2.0])
    groups = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [1, 1, 1], [1, 0, 0]])
    full_b = reinforce_pp_baseline_advantages(scores, mask, groups)
    full_r, returns = reinforce_pp_advantages(scores, mask, 0.9)

    def global_stats(of):
        m = mask.float()
        mean = (of * m).sum() / m.sum()
        return lambda values, _mask: (mean, ((of - mean) ** 2 * m).sum() / (m.sum() - 1))

    centred = torch.tensor([0.5, -0.5, 0.5, -0.5]).unsqueeze(-1) * mask
    for half in (slice(0, 2), slice(2, 4)):
        got = reinforce_pp_baseline_advantages(scores[half], mask[half], groups[half], global_stats(centred))
        torch.testing.assert_close(got, full_b[half])
        got, _ = reinforce_pp_advantages(scores[half], mask[half], 0.9, global_stats(returns))
        torch.testing.assert_close(got, full_r[half])


def test_whitening_needs_two_tokens():
    adv, _ = reinforce_pp_advantages(torch.tensor([1.0]), torch.tensor([[1, 0]]))
    assert adv.tolist() == [[0.0, 0.0]]


# -- DAPO ------------------------------------------------------------------------------------


def test_varied_groups_drops_groups_with_equal_rewards():
    scores = torch.tensor([1.0, 1.0, 0.0, 2.0, 3.0, 3.0, 3.0, 5.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 2, 3])
    # group 0 and 2 are uniform; group 3 has one response and is kept (verl's DAPO recipe)
    assert varied_groups(scores, groups).tolist() == [False, False, True, True, False, False, False, True]


def test_overlong_penalty_is_linear_in_the_buffer():
    lengths = torch.tensor([4, 8, 10, 12])
    assert overlong_penalty(lengths, 12, 4).tolist() == [0.0, 0.0, -0.5, -1.0]
    assert overlong_penalty(lengths, 12, 4, penalty_factor=0.5).tolist() == [0.0, 0.0, -0.25, -0.5]


# -- GSPO ------------------------------------------------------------------------------------


def test_gspo_clips_the_sequence_ratio_and_gives_every_token_the_sequence_gradient():
    old = torch.zeros(2, 3)
    delta = torch.tensor([[0.1, 0.3, 5.0], [-0.2, 7.0, -0.4]])  # masked values are ignored
    logp = delta.clone().requires_grad_(True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    adv = torch.ones(2, 3)
    loss, m = gspo_policy_loss(old, logp, adv, mask, clip_low=0.2, clip_high=0.2)
    s0, s1 = math.exp(0.2), math.exp(-0.3)  # exp of the mean log ratio of each sequence
    # row 0: max(-s0, -1.2) = -1.2 (clipped); row 1: max(-s1, -0.8) = -s1; seq-mean-token-mean
    assert s0 > 1.2
    assert loss.item() == pytest.approx((-1.2 - s1) / 2, rel=1e-6)
    assert m["clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    # clipped row: no gradient; row 1: each token gets -s1 / (2 tokens x 2 sequences), the
    # sequence ratio, not its own token ratio (exp(-0.2) or exp(-0.4))
    close(logp.grad, [[0, 0, 0], [-s1 / 4, 0, -s1 / 4]])


def test_gspo_ratio_is_one_on_policy():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, m = gspo_policy_loss(logp.detach(), logp, torch.full((1, 2), -2.0), torch.ones(1, 2))
    assert loss.item() == pytest.approx(2.0)  # -A * 1
    assert m["ppo_kl"].item() == 0.0


# -- an agent episode's earlier branches: rows of their own, counted once -------------------------


def test_group_stats_count_each_episode_once():
    # group 0: episodes scored 1 and 0, the first with two earlier branches (rows 2, 3) repeating its 1
    scores, groups = torch.tensor([1.0, 0.0, 1.0, 1.0, 5.0]), torch.tensor([0, 0, 0, 0, 1])
    counted = torch.tensor([True, True, False, False, True])
    mean, std, n = F.group_stats(scores, groups, counted)
    assert mean.tolist() == [0.5, 0.5, 0.5, 0.5, 0.0]  # counting every row would give 0.75
    assert std.tolist() == pytest.approx([math.sqrt(0.5)] * 4 + [1.0])
    assert n.tolist() == [2, 2, 2, 2, 1]
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    close(
        group_advantages(scores, torch.ones(5, 1), groups, eps=1e-6, counted=counted),
        [[a], [-a], [a], [a], [5 / (1 + 1e-6)]],
    )
    # RLOO: 1 - 0 = 1 and 0 - 1 = -1 over the two episodes, the branches with their episode's
    close(rloo_advantages(scores, torch.ones(5, 1), groups, counted), [[1.0], [-1.0], [1.0], [1.0], [5.0]])
    centred = reinforce_pp_baseline_advantages(scores, torch.ones(5, 1), groups, counted=counted)
    close(centred, [[w] for w in whiten([0.5, -0.5, 0.5, 0.5, 5.0])])  # then whitened over every row's tokens


def test_counted_rows_are_all_but_the_branch_rows():
    from hybridrl.batch import Batch

    batch = Batch()
    batch["scores"] = torch.zeros(3)
    assert F.counted_rows(batch) is None
    batch["branch_row"] = torch.tensor([False, True, False])
    assert F.counted_rows(batch).tolist() == [True, False, True]
