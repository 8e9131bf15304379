"""Score shaping against hand-computed values."""

import math

import pytest
import torch
from pydantic import ValidationError

from hybridrl.shaping import RunningStats, ShapingOptions, ShapingState, shape_scores, update_stats

EPS = 1e-8


def shaped(values, lengths=None, stats=None, **options):
    out, stats = shape_scores(
        torch.tensor(values), None if lengths is None else torch.tensor(lengths), ShapingOptions(**options), stats
    )
    return out.tolist(), stats


def test_defaults_change_nothing():
    opts = ShapingOptions()
    assert not opts.active
    assert shaped([0.5, -2.0, 3.0]) == ([0.5, -2.0, 3.0], None)


def test_batch_normalisation_uses_unbiased_variance():
    # mean 2.5, unbiased var (2.25 + 0.25 + 0.25 + 2.25) / 3 = 5/3
    out, stats = shaped([1.0, 2.0, 3.0, 4.0], normalize="batch")
    s = math.sqrt(5 / 3 + EPS)
    assert out == pytest.approx([-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s], abs=1e-6)
    assert stats is None  # batch normalisation keeps no state


def test_batch_normalisation_without_centering_keeps_the_sign():
    # values 2 and 4: mean 3, unbiased var 2 -> divide by sqrt(2)
    out, _ = shaped([2.0, 4.0], normalize="batch", center=False)
    assert out == pytest.approx([2 / math.sqrt(2), 4 / math.sqrt(2)], abs=1e-6)


def test_running_normalisation_is_exact_over_all_scores_seen():
    out1, stats = shaped([1.0, 3.0], normalize="running")
    # first batch: mean 2, unbiased var ((1)^2 + (1)^2) / 1 = 2
    assert stats == RunningStats(2, 2.0, 2.0)
    assert out1 == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)], abs=1e-6)
    out2, stats = shaped([5.0, 7.0], stats=stats, normalize="running")
    # all four: mean 4, unbiased var (9 + 1 + 1 + 9) / 3 = 20/3
    assert (stats.count, stats.mean) == (4, 4.0) and stats.var == pytest.approx(20 / 3)
    assert out2 == pytest.approx([1 / math.sqrt(20 / 3), 3 / math.sqrt(20 / 3)], abs=1e-6)


def test_running_merge_equals_the_statistics_of_the_concatenation():
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(n, generator=gen) * 3 + 1 for n in (1, 5, 2, 8)]
    stats = RunningStats()
    for p in parts:
        stats = update_stats(stats, p)
    everything = torch.cat(parts).double()
    assert stats.count == 16
    assert stats.mean == pytest.approx(everything.mean().item(), abs=1e-9)
    assert stats.var == pytest.approx(everything.var(unbiased=True).item(), abs=1e-9)


def test_running_normalisation_with_momentum():
    _, stats = shaped([1.0, 3.0], normalize="running", momentum=0.5)  # init: mean 2, var 2
    out, stats = shaped([5.0, 7.0], stats=stats, normalize="running", momentum=0.5)
    # batch mean 6, var 2 -> mean 0.5 * 2 + 0.5 * 6 = 4, var 0.5 * 2 + 0.5 * 2 = 2
    assert (stats.count, stats.mean, stats.var) == (4, 4.0, 2.0)
    assert out == pytest.approx([1 / math.sqrt(2), 3 / math.sqrt(2)], abs=1e-6)


def test_length_penalty_counts_tokens_beyond_the_free_ones():
    out, _ = shaped([1.0, 1.0, 1.0], lengths=[5, 10, 30], length_penalty=0.01, length_free_tokens=10)
    assert out == pytest.approx([1.0, 1.0, 0.8], abs=1e-7)


def test_dapo_style_soft_overlong_penalty():
    # max_tokens 20, buffer 4: no penalty up to 16 tokens, -1 at 20
    out, _ = shaped([0.0, 0.0, 0.0], lengths=[16, 18, 20], length_penalty=1 / 4, length_free_tokens=16)
    assert out == pytest.approx([0.0, -0.5, -1.0])


def test_order_is_normalise_then_penalty_then_clip():
    # normalised [-1/sqrt(2), 1/sqrt(2)] = [-0.7071, 0.7071]; penalty 0.5 on the second (10 tokens x 0.05)
    out, _ = shaped([1.0, 3.0], lengths=[0, 10], normalize="batch", length_penalty=0.05, clip=(-0.5, 0.5))
    assert out == pytest.approx([-0.5, 1 / math.sqrt(2) - 0.5], abs=1e-6)


def test_clip():
    out, _ = shaped([-7.0, 0.25, 9.0], clip=(-1, 1))
    assert out == [-1.0, 0.25, 1.0]


def test_inputs_are_not_mutated_and_state_round_trips():
    scores, stats = torch.tensor([1.0, 3.0]), RunningStats(2, 0.0, 1.0)
    out, new = shape_scores(scores, None, ShapingOptions(normalize="running"), stats)
    assert scores.tolist() == [1.0, 3.0] and stats == RunningStats(2, 0.0, 1.0) and new != stats
    assert RunningStats.from_state_dict(new.state_dict()) == new


def test_non_finite_scores_are_an_error_naming_the_rows():
    with pytest.raises(ValueError, match=r"rows \[1\] are not finite \(nan\)"):
        shape_scores(torch.tensor([0.0, float("nan")]), None, ShapingOptions(normalize="running"))


def test_length_penalty_needs_lengths():
    with pytest.raises(ValueError, match="no response lengths"):
        shape_scores(torch.tensor([0.0]), None, ShapingOptions(length_penalty=0.1))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"clip": (1, -1)}, r"low < high, got \[1.0, -1.0\]"),
        ({"momentum": 0.1}, "momentum applies to normalize=running only"),
        ({"normalise": "batch"}, "Extra inputs are not permitted"),
        ({"length_penalty": -1}, "greater than or equal to 0"),
    ],
)
def test_invalid_options_are_rejected(options, message):
    with pytest.raises(ValidationError, match=message):
        ShapingOptions(**options)


def test_shaping_state_keeps_each_rewards_statistics_and_round_trips():
    state, running = ShapingState(), ShapingOptions(normalize="running")
    state.apply("a", torch.tensor([1.0, 3.0]), None, running)
    state.apply("b", torch.tensor([10.0, 10.0, 40.0]), None, running)
    state.apply("c", torch.tensor([5.0]), None, ShapingOptions(clip=(0, 1)))  # nothing to keep
    out = state.apply("a", torch.tensor([5.0, 7.0]), None, running)
    assert out.tolist() == pytest.approx([1 / math.sqrt(20 / 3), 3 / math.sqrt(20 / 3)], abs=1e-6)  # as above
    assert set(state.stats) == {"a", "b"} and state.stats["b"] == RunningStats(3, 20.0, 300.0)
    restored = ShapingState()
    restored.load_state_dict(torch.load(_saved(state.state_dict()), weights_only=True))
    assert restored.stats == state.stats


def _saved(obj):
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf
