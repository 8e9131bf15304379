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
    algo = GRPO(GRPO.Options(kl_coef=0.5, kl_kind="k2"), ctx=None)
    assert algo.needs_reference
    b = Batch()
    b["response_mask"] = torch.ones(1, 2)
    b["old_logprobs"] = torch.zeros(1, 2)
    b["ref_logprobs"] = torch.tensor([[-1.0, -1.0]])
    b["advantages"] = torch.tensor([[1.0, 1.0]])
    loss, m = algo.loss(b, torch.zeros(1, 2), torch.zeros(1, 2))
    # pg loss: -A * ratio = -1 per token; k2 kl = (0 - (-1))^2 / 2 = 0.5 per token
    assert loss.item() == pytest.approx(-1 + 0.5 * 0.5)
    assert m["actor/kl"] == pytest.approx(0.5)


@pytest.mark.parametrize("kind, why", [("k1", "E\\[grad log pi\\] = 0"), ("abs", "not that of a divergence")])
def test_kl_estimators_that_do_not_regularise_as_a_loss_are_refused(kind, why):
    from hybridrl.config import ConfigError, load_config

    data = {
        "model": {"path": "/m"},
        "data": {"source": "reasoning_gym", "task": "chain_sum"},
        "rewards": [{"function": "answer_match"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.1, "kl_kind": kind},
    }
    with pytest.raises(ConfigError, match=f"KL estimator '{kind}' as a loss term: .*{why}.*Use k3 .* or k2"):
        load_config(data=data)


def test_no_reference_without_kl():
    from hybridrl import plugins

    GRPO = plugins.lookup("algorithm", "grpo")
    assert not GRPO(GRPO.Options(), ctx=None).needs_reference


# -- loss variants -------------------------------------------------------------------------


def make_grpo(**options):
    from hybridrl import plugins

    GRPO = plugins.lookup("algorithm", "grpo")
    return GRPO(GRPO.Options(**options), ctx=None)


def minibatch(old, adv, mask, ref=None):
    b = Batch()
    b["response_mask"] = torch.as_tensor(mask)
    b["old_logprobs"] = torch.as_tensor(old, dtype=torch.float32)
    b["advantages"] = torch.as_tensor(adv, dtype=torch.float32)
    if ref is not None:
        b["ref_logprobs"] = torch.as_tensor(ref, dtype=torch.float32)
    return b


@pytest.mark.parametrize("clip_high, expected", [(0.2, -1.2), (0.28, -1.25)])
def test_clip_higher_lets_positive_advantages_push_further(clip_high, expected):
    algo = make_grpo(clip_low=0.2, clip_high=clip_high)
    b = minibatch(torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    loss, _ = algo.loss(b, torch.full((1, 2), math.log(1.25)), torch.zeros(1, 2))
    assert loss.item() == pytest.approx(expected)


@pytest.mark.parametrize("clip_low, expected", [(0.2, 0.8), (0.3, 0.75)])
def test_clip_low_bounds_negative_advantages(clip_low, expected):
    algo = make_grpo(clip_low=clip_low)
    b = minibatch(torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1))
    loss, m = algo.loss(b, torch.full((1, 1), math.log(0.75)), torch.zeros(1, 1))
    # -A * max(r, clip(r)) with A = -1, r = 0.75: clip_low 0.2 lifts the ratio to 0.8
    assert loss.item() == pytest.approx(expected)
    assert m["actor/clipfrac"] == (1.0 if clip_low == 0.2 else 0.0)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (-1 - 2 * 3) / 4),
        ("seq-mean-token-mean", (-1 + -2) / 2),
        ("seq-mean-token-sum", (-1 + -6) / 2),
        ("seq-mean-token-sum-norm", (-1 - 6) / (2 * 3)),  # N x L; L = T = 3 without a run's max_tokens
    ],
)
def test_aggregation_modes_weigh_long_and_short_responses(mode, expected):
    # on policy (ratio 1) the token loss is -A; a 1-token response with A = 1, a 3-token one with A = 2
    algo = make_grpo(loss_agg_mode=mode)
    mask = [[1, 0, 0], [1, 1, 1]]
    b = minibatch(torch.zeros(2, 3), [[1.0, 0, 0], [2.0, 2.0, 2.0]], mask)
    loss, _ = algo.loss(b, torch.zeros(2, 3), torch.zeros(2, 3))
    assert algo.loss_agg_mode == mode
    assert loss.item() == pytest.approx(expected)


def test_gspo_defaults_follow_the_paper_and_can_be_overridden():
    algo = make_grpo(policy_loss="gspo")
    assert (algo.clip_low, algo.clip_high, algo.loss_agg_mode) == (3e-4, 4e-4, "seq-mean-token-mean")
    algo = make_grpo(policy_loss="gspo", clip_high=1e-3, loss_agg_mode="token-mean")
    assert (algo.clip_low, algo.clip_high, algo.loss_agg_mode) == (3e-4, 1e-3, "token-mean")
    vanilla = make_grpo()
    assert (vanilla.clip_low, vanilla.clip_high, vanilla.loss_agg_mode) == (0.2, 0.2, "token-mean")


def test_gspo_loss_uses_the_sequence_ratio():
    algo = make_grpo(policy_loss="gspo")
    # token ratios e^0.2 and 1 (inside no clip range of 3e-4) vs the sequence ratio e^0.1
    b = minibatch(torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    loss, m = algo.loss(b, torch.tensor([[0.2, 0.0]]), torch.zeros(1, 2))
    assert loss.item() == pytest.approx(-(1 + 4e-4))  # s = e^0.1 > 1 + 4e-4: clipped
    assert m["actor/clipfrac"] == 1.0


def test_entropy_bonus_and_default_k3_kl():
    algo = make_grpo(entropy_coeff=0.1, kl_coef=0.5)
    assert algo.needs_entropy_grad and algo.needs_reference
    b = minibatch(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), ref=torch.full((1, 2), -1.0))
    loss, m = algo.loss(b, torch.zeros(1, 2), torch.tensor([[2.0, 4.0]]))
    k3 = math.exp(-1) - (-1) - 1  # x = ref - logp = -1
    assert m["actor/kl"] == pytest.approx(k3)
    assert m["actor/entropy_loss"] == pytest.approx(3.0)
    assert loss.item() == pytest.approx(0 - 0.1 * 3.0 + 0.5 * k3)
    assert not make_grpo().needs_entropy_grad


# -- advantages through the algorithm, DAPO ------------------------------------------------


def scored_batch(scores, groups, lengths, T=4):
    b = Batch()
    b["response_mask"] = torch.tensor([[1] * n + [0] * (T - n) for n in lengths])
    b["scores"] = torch.tensor(scores)
    b["group_ids"] = torch.tensor(groups)
    return b


def test_overlong_penalty_enters_the_advantage():
    algo = make_grpo(estimator="rloo", overlong_buffer_len=2, overlong_max_length=4)
    b = scored_batch([1.0, 1.0], [0, 0], [2, 4])
    metrics = algo.compute_advantages(b)
    # penalties 0 and -1 -> scores 1 and 0 -> RLOO +1 and -1
    assert b["advantages"][:, 0].tolist() == pytest.approx([1.0, -1.0])
    assert b["overlong_penalty"].tolist() == [0.0, -1.0]
    assert metrics["reward/overlong_fraction"] == 0.5


@pytest.mark.parametrize(
    "estimator, expected",
    [
        ("grpo", [1 / (math.sqrt(2) + 1e-6), -1 / (math.sqrt(2) + 1e-6)]),
        ("rloo", [2.0, -2.0]),
        ("reinforce_plus_plus_baseline", [1 / math.sqrt(4 / 3 + 1e-8), -1 / math.sqrt(4 / 3 + 1e-8)]),
    ],
)
def test_estimator_option_chooses_the_estimator(estimator, expected):
    algo = make_grpo(estimator=estimator)
    b = scored_batch([3.0, 1.0], [0, 0], [2, 2])
    algo.compute_advantages(b)
    assert b["advantages"][:, 0].tolist() == pytest.approx(expected, rel=1e-6)


def test_dynamic_sampling_drops_uniform_groups_and_reports_it():
    algo = make_grpo(dynamic_sampling=True)
    b = scored_batch([1.0, 1.0, 0.0, 1.0, 0.5], [0, 0, 1, 1, 2], [1, 2, 3, 4, 1])
    kept, metrics = algo.filter_batch(b)
    assert kept["group_ids"].tolist() == [1, 1, 2] and kept["scores"].tolist() == [0.0, 1.0, 0.5]
    assert metrics["dynamic_sampling/kept_groups"] == 2.0
    assert metrics["dynamic_sampling/kept_fraction"] == pytest.approx(2 / 3)
    assert "dynamic_sampling/kept_groups" not in algo.compute_advantages(kept)  # with the batch, not after it


def test_dynamic_sampling_can_empty_the_batch_without_crashing():
    algo = make_grpo(dynamic_sampling=True, overlong_buffer_len=1, overlong_max_length=4)
    empty, metrics = algo.filter_batch(scored_batch([1.0, 1.0], [0, 0], [1, 2]))
    assert len(empty) == 0 and empty["response_mask"].shape == (0, 4)
    assert metrics["dynamic_sampling/kept_fraction"] == 0.0
    algo.compute_advantages(empty)
    assert empty["advantages"].shape == (0, 4)


def test_dynamic_sampling_off_keeps_everything():
    b = scored_batch([1.0, 1.0], [0, 0], [1, 2])
    kept, metrics = make_grpo().filter_batch(b)
    assert kept is b and metrics == {}


def test_overlong_without_max_length_is_a_config_error():
    from hybridrl.config import ConfigError, load_config

    cfg = {
        "model": {"path": "unused"},
        "data": {"source": "reasoning_gym", "task": "chain_sum"},
        "rewards": [{"function": "answer_match"}],
        "algorithm": {"name": "grpo", "overlong_buffer_len": 4},
    }
    with pytest.raises(ConfigError, match="algorithm.overlong_max_length: .*set it to rollout.max_tokens"):
        load_config(data=cfg)
    cfg["algorithm"]["overlong_max_length"] = 4
    with pytest.raises(ConfigError, match="larger than overlong_buffer_len=4"):
        load_config(data=cfg)
