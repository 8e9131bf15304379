"""Off-policy correction from the engine's logprobs: every weight and mask variant against
hand-computed values, on a batch with a hole (an observation token inside a response) and padding."""

import math

import pytest
import torch
from pydantic import ValidationError

from hybridrl import functional as F
from hybridrl.batch import Batch
from hybridrl.correction import RolloutCorrectionOptions, rollout_correction

MASK = torch.tensor([[1, 1, 0, 1], [1, 1, 0, 0]])  # row 0: a hole at t = 2; row 1: padding after t = 1
# token ratios pi_old / pi_rollout on the valid tokens: row 0: 3, 0.5, 1.5; row 1: 0.25, 1.2
RATIOS = [[3.0, 0.5, None, 1.5], [0.25, 1.2, None, None]]


def close(actual, expected):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=1e-6, atol=1e-7)


def logprobs():
    """(old, rollout) with the ratios above; at the hole the engine's logprob is -inf (it never sampled
    that token) and the trainer's -5, on padding both 0: none of it may count."""
    rollout = torch.tensor([[-1.0, -2.0, float("-inf"), -0.5], [-0.7, -1.2, 0.0, 0.0]])
    old = rollout.clone()
    for i, row in enumerate(RATIOS):
        for t, r in enumerate(row):
            if r is not None:
                old[i, t] = rollout[i, t] + math.log(r)
    old[0, 2] = -5.0
    return old, rollout


def test_token_tis_truncates_each_token_and_zeroes_holes():
    old, rollout = logprobs()
    w, truncated = F.truncated_is_weights(old, rollout, MASK, "token", cap=2.0)
    assert w.dtype == torch.float32 and not w.requires_grad
    close(w, [[2.0, 0.5, 0.0, 1.5], [0.25, 1.2, 0.0, 0.0]])
    assert truncated.tolist() == [[True, False, False, False], [False, False, False, False]]


def test_sequence_tis_is_the_truncated_product_of_the_token_ratios():
    old, rollout = logprobs()
    # row 0: 3 x 0.5 x 1.5 = 2.25 (the hole's ratio, +inf, is left out); row 1: 0.25 x 1.2 = 0.3
    w, truncated = F.truncated_is_weights(old, rollout, MASK, "sequence", cap=3.0)
    close(w, [[2.25, 2.25, 0.0, 2.25], [0.3, 0.3, 0.0, 0.0]])
    assert not truncated.any()
    w, truncated = F.truncated_is_weights(old, rollout, MASK, "sequence", cap=2.0)
    close(w, [[2.0, 2.0, 0.0, 2.0], [0.3, 0.3, 0.0, 0.0]])
    assert truncated.tolist() == [[True, True, False, True], [False, False, False, False]]


def test_geometric_tis_is_the_geometric_mean_over_the_valid_tokens():
    old, rollout = logprobs()
    w, truncated = F.truncated_is_weights(old, rollout, MASK, "geometric", cap=2.0)
    g0, g1 = 2.25 ** (1 / 3), 0.3**0.5  # 3 valid tokens in row 0 (not 4), 2 in row 1 (not 4)
    close(w, [[g0, g0, 0.0, g0], [g1, g1, 0.0, 0.0]])
    assert not truncated.any()


def test_token_mask_keeps_ratios_inside_the_band_bounds_included():
    old, rollout = logprobs()
    keep = F.rollout_ratio_mask(old, rollout, MASK, "token", low=0.5, high=2.0)
    # 3 and 0.25 are outside [0.5, 2]; 0.5 is on the bound and kept; the hole and padding are 0
    assert keep.tolist() == [[0.0, 1.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]]


@pytest.mark.parametrize("level, low, high", [("sequence", 0.5, 2.5), ("geometric", 0.6, 1.5)])
def test_sequence_and_geometric_masks_drop_whole_responses(level, low, high):
    old, rollout = logprobs()
    # sequence ratios 2.25 and 0.3; geometric 1.31 and 0.55: row 0 is kept, row 1 dropped
    keep = F.rollout_ratio_mask(old, rollout, MASK, level, low, high)
    assert keep.tolist() == [[1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]


def test_metrics_count_valid_tokens_only():
    old, rollout = logprobs()
    w, truncated = F.truncated_is_weights(old, rollout, MASK, "token", cap=2.0)
    keep = F.rollout_ratio_mask(old, rollout, MASK, "token", low=0.5, high=2.0)
    m = F.rollout_correction_metrics(old, rollout, MASK, w * keep, truncated, keep)
    # weights on the 5 valid tokens: 0 (ratio 3, masked), 0.5, 1.5, 0 (ratio 0.25, masked), 1.2
    ratios = [3.0, 0.5, 1.5, 0.25, 1.2]
    assert float(m["rollout_corr/weight_mean"]) == pytest.approx(3.2 / 5, rel=1e-6)
    assert float(m["rollout_corr/weight_max"]) == pytest.approx(1.5, rel=1e-6)
    assert float(m["rollout_corr/weight_min"]) == 0.0
    assert float(m["rollout_corr/truncated_fraction"]) == pytest.approx(1 / 5)
    assert float(m["rollout_corr/masked_fraction"]) == pytest.approx(2 / 5)
    kl_k1 = sum(-math.log(r) for r in ratios) / 5  # E_rollout[log pi_rollout - log pi_old]
    kl_k3 = sum(r - math.log(r) - 1 for r in ratios) / 5
    assert float(m["rollout_corr/kl_k1"]) == pytest.approx(kl_k1, rel=1e-5)
    assert float(m["rollout_corr/kl_k3"]) == pytest.approx(kl_k3, rel=1e-5)


def test_metrics_without_truncation_or_mask_leave_their_fractions_out():
    old, rollout = logprobs()
    w, _ = F.truncated_is_weights(old, rollout, MASK, "token", cap=2.0)
    m = F.rollout_correction_metrics(old, rollout, MASK, w)
    assert "rollout_corr/truncated_fraction" not in m and "rollout_corr/masked_fraction" not in m
    assert float(m["rollout_corr/weight_mean"]) == pytest.approx((2 + 0.5 + 1.5 + 0.25 + 1.2) / 5, rel=1e-6)
    assert float(m["rollout_corr/weight_min"]) == pytest.approx(0.25, rel=1e-6)


def test_an_empty_mask_gives_neutral_extremes():
    old, rollout = logprobs()
    empty = torch.zeros_like(MASK)
    w, truncated = F.truncated_is_weights(old, rollout, empty, "sequence")
    m = F.rollout_correction_metrics(old, rollout, empty, w, truncated)
    assert w.abs().sum() == 0 and not truncated.any()
    assert float(m["rollout_corr/weight_max"]) == 0.0 and float(m["rollout_corr/weight_min"]) == math.inf
    assert float(m["rollout_corr/weight_mean"]) == 0.0 and float(m["rollout_corr/kl_k3"]) == 0.0


def test_weights_are_float32_detached_and_clamped_masks_compare_unclamped():
    mask = torch.ones(1, 3)
    rollout = torch.zeros(1, 3, dtype=torch.bfloat16)
    old = torch.full((1, 3), 10.0, dtype=torch.bfloat16, requires_grad=True)  # sequence log ratio 30
    w, _ = F.truncated_is_weights(old, rollout, mask, "sequence", cap=1e12)
    assert w.dtype == torch.float32 and not w.requires_grad
    assert w[0, 0].item() == pytest.approx(math.exp(20.0), rel=1e-6)  # the log ratio is clamped at 20
    # the band compares the log ratio itself: 30 > 25, masked, though the clamped 20 would be inside
    assert F.rollout_ratio_mask(old, rollout, mask, "sequence", 0.5, math.exp(25)).sum() == 0


def test_unknown_level_names_the_choices():
    old, rollout = logprobs()
    with pytest.raises(ValueError, match="Unknown rollout correction level 'seq'. Available: token, sequence, geo"):
        F.truncated_is_weights(old, rollout, MASK, "seq")


def test_policy_loss_token_weights_keep_the_normaliser_and_weigh_the_gradient():
    old, _ = logprobs()
    old = torch.where(MASK.bool(), old, 0.0)
    logp = old.clone().requires_grad_(True)  # ratio 1: no clipping
    adv = torch.tensor([[1.0, -2.0, 0.0, 0.5], [3.0, 1.0, 0.0, 0.0]])
    w = torch.tensor([[0.0, 0.5, 0.0, 1.5], [0.25, 1.2, 0.0, 0.0]])
    loss, m = F.policy_loss(old, logp, adv, MASK, token_weights=w)
    # token-mean over the 5 valid tokens, the one with weight 0 included: sum(-A w) / 5
    expected = -(0.0 * 1 + 0.5 * -2 + 1.5 * 0.5 + 0.25 * 3 + 1.2 * 1) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    # d/d logp of -A w exp(logp - old) at logp = old: -A w / 5 on valid tokens, 0 elsewhere
    close(logp.grad, -adv * w * MASK / 5)
    assert float(m["clipfrac"]) == 0.0
    unweighted, _ = F.policy_loss(old, logp.detach(), adv, MASK)
    assert unweighted.item() == pytest.approx(-(1 - 2 + 0.5 + 3 + 1) / 5, rel=1e-6)


def batch(with_rollout=True):
    old, rollout = logprobs()
    b = Batch()
    b["response_mask"], b["old_logprobs"] = MASK, old
    if with_rollout:
        b["rollout_logprobs"] = rollout
    return b


def test_rollout_correction_combines_truncation_and_mask():
    o = RolloutCorrectionOptions(rollout_correction="token", rollout_mask="token", rollout_mask_high=2.0)
    w, m = rollout_correction(batch(), o)
    # kept tokens keep their truncated weight (ratio 1.5 -> 1.5, 0.5 -> 0.5, 1.2 -> 1.2); 3 and 0.25 masked
    close(w, [[0.0, 0.5, 0.0, 1.5], [0.0, 1.2, 0.0, 0.0]])
    assert float(m["rollout_corr/masked_fraction"]) == pytest.approx(2 / 5)
    assert float(m["rollout_corr/truncated_fraction"]) == pytest.approx(1 / 5)


def test_rollout_mask_alone_gives_zero_one_weights():
    w, m = rollout_correction(batch(), RolloutCorrectionOptions(rollout_mask="sequence", rollout_mask_high=2.5))
    assert w.tolist() == [[1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    assert "rollout_corr/truncated_fraction" not in m
    assert float(m["rollout_corr/weight_mean"]) == pytest.approx(3 / 5)


def test_off_or_without_engine_logprobs_changes_nothing():
    assert rollout_correction(batch(), RolloutCorrectionOptions()) == (None, {})
    assert rollout_correction(batch(with_rollout=False), RolloutCorrectionOptions(rollout_correction="token")) == (
        None,
        {},
    )


@pytest.mark.parametrize(
    "options, message",
    [
        ({"rollout_correction_cap": 1.0}, "rollout_correction_cap\n  Value error, must be above 1: the weights are"),
        ({"rollout_mask_low": 1.0}, "rollout_mask_low\n  Value error, must be between 0 and 1"),
        ({"rollout_mask_low": 0.0}, "rollout_mask_low\n  Value error, must be between 0 and 1"),
        ({"rollout_mask_high": 0.9}, "rollout_mask_high\n  Value error, must be above 1: ratios above it"),
        ({"rollout_correction": "tokens"}, "rollout_correction\n  Input should be 'off', 'token', 'sequence'"),
    ],
)
def test_options_are_validated(options, message):
    with pytest.raises(ValidationError, match=message):
        RolloutCorrectionOptions(**options)


def test_extreme_metrics_are_reduced_as_such_the_others_weighted_by_tokens():
    from hybridrl.metrics import extreme

    old, rollout = logprobs()
    w, truncated = F.truncated_is_weights(old, rollout, MASK, "token")
    m = F.rollout_correction_metrics(old, rollout, MASK, w, truncated)
    assert {k: extreme(k) for k in m if extreme(k)} == {
        "rollout_corr/weight_max": "max",
        "rollout_corr/weight_min": "min",
    }
