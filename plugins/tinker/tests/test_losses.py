"""The built-in losses of Tinker's forward_backward (hybridrl_tinker.losses) against numbers worked out
by hand on a 3-token datum, their gradients w.r.t. target_logprobs against the hand-derived ones, and
the errors of ``loss`` for what a client can get wrong (docs/tinker.md)."""

import inspect
import math

import numpy as np
import pytest
import torch
from hybridrl_tinker import losses
from hybridrl_tinker.losses import LOSSES, cispo, cross_entropy, dro, gspo, importance_sampling, loss, ppo

# The datum used throughout: 3 target tokens with these logprobs under the trained weights,
TARGET = [-1.0, -2.0, -0.5]
# and sampler logprobs chosen so that the ratios p/q = exp(target - sampling) are 1, 1.5 and 0.5:
RATIOS = [1.0, 1.5, 0.5]
SAMPLING = [t - math.log(r) for t, r in zip(TARGET, RATIOS)]


def leaf(values):
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def data(values):
    return torch.tensor(values, dtype=torch.float64)


def value_and_grad(fn, *args, **kwargs):
    """The loss and d loss / d target_logprobs, through torch.autograd."""
    target = leaf(TARGET)
    out = fn(target, *args, **kwargs)
    out.backward()
    return out.item(), target.grad.tolist()


def close(got, want):
    return got == pytest.approx(want, abs=1e-12)


# -- cross_entropy --------------------------------------------------------------------------------


def test_cross_entropy_sums_the_weighted_negative_logprobs():
    # weights 0, 1, 1 (a prompt token, then two completion tokens):
    # loss = -(0 * -1 + 1 * -2 + 1 * -0.5) = 2.5, a sum (the mean would be 0.8333)
    # d loss / d t_i = -w_i = [0, -1, -1]
    value, grad = value_and_grad(cross_entropy, data([0.0, 1.0, 1.0]))
    assert close(value, 2.5) and close(grad, [0.0, -1.0, -1.0])


def test_cross_entropy_takes_negative_and_fractional_weights():
    # forward_backward_custom sends weights = -dLoss/dlogprobs, any floats: w = [0.5, -1, 2]
    # loss = -(0.5 * -1 + -1 * -2 + 2 * -0.5) = -(-0.5 + 2 - 1) = -0.5
    # d loss / d t_i = -w_i = [-0.5, 1, -2]: the gradient the custom loss asked for, negated back
    value, grad = value_and_grad(cross_entropy, data([0.5, -1.0, 2.0]))
    assert close(value, -0.5) and close(grad, [-0.5, 1.0, -2.0])


def test_cross_entropy_top_k_sums_every_candidate():
    # (N, K) = (2, 2) for top-K distillation: logprobs [[-1, -2], [-0.5, -3]], weights [[0.75, 0.25], [1, 0]]
    # loss = -(0.75 * -1 + 0.25 * -2 + 1 * -0.5 + 0 * -3) = -(-0.75 - 0.5 - 0.5) = 1.75
    target = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], dtype=torch.float64, requires_grad=True)
    out = loss("cross_entropy", target, {"target_tokens": [[5, 6], [7, 8]], "weights": [[0.75, 0.25], [1.0, 0.0]]})
    out.backward()
    assert close(out.item(), 1.75) and close(target.grad.flatten().tolist(), [-0.75, -0.25, -1.0, 0.0])


# -- importance_sampling --------------------------------------------------------------------------


def test_importance_sampling():
    # ratios [1, 1.5, 0.5], advantages [2, -1, 4]: r * A = [2, -1.5, 2], sum 2.5, loss = -2.5
    # d/dt (r_i A_i) = r_i A_i (d r / d t = r), so d loss / d t = -r * A = [-2, 1.5, -2]
    value, grad = value_and_grad(importance_sampling, data(SAMPLING), data([2.0, -1.0, 4.0]))
    assert close(value, -2.5) and close(grad, [-2.0, 1.5, -2.0])


# -- ppo ------------------------------------------------------------------------------------------


def test_ppo_positive_advantages_clip_above_not_below():
    # thresholds 0.8 / 1.2: ratios [1, 1.5, 0.5] clip to [1, 1.2, 0.8]; advantages [1, 2, 2]
    # token 0: min(1 * 1, 1 * 1) = 1                   -> gradient -r A = -1
    # token 1: min(1.5 * 2, 1.2 * 2) = min(3, 2.4) = 2.4 (clipped term: a constant, gradient 0)
    # token 2: min(0.5 * 2, 0.8 * 2) = min(1, 1.6) = 1   (unclipped: gradient -r A = -0.5 * 2 = -1)
    # loss = -(1 + 2.4 + 1) = -4.4
    value, grad = value_and_grad(ppo, data(SAMPLING), data([1.0, 2.0, 2.0]), 0.8, 1.2)
    assert close(value, -4.4) and close(grad, [-1.0, 0.0, -1.0])


def test_ppo_negative_advantages_clip_below_not_above():
    # advantages [-1, -2, -2], same ratios and thresholds
    # token 0: min(-1, -1) = -1                          -> gradient -r A = 1
    # token 1: min(1.5 * -2, 1.2 * -2) = min(-3, -2.4) = -3 (unclipped: gradient -1.5 * -2 = 3)
    # token 2: min(0.5 * -2, 0.8 * -2) = min(-1, -1.6) = -1.6 (clipped: gradient 0)
    # loss = -(-1 - 3 - 1.6) = 5.6
    value, grad = value_and_grad(ppo, data(SAMPLING), data([-1.0, -2.0, -2.0]), 0.8, 1.2)
    assert close(value, 5.6) and close(grad, [1.0, 3.0, 0.0])


def test_ppo_defaults_are_one_plus_or_minus_0_2_and_config_overrides_them():
    inputs = {"target_tokens": [1, 2, 3], "logprobs": SAMPLING, "advantages": [1.0, 2.0, 2.0]}
    assert close(loss("ppo", data(TARGET), inputs).item(), -4.4)  # as with 0.8 / 1.2 above
    # thresholds 0.4 / 2.0 clip neither token: loss = -(1 * 1 + 1.5 * 2 + 0.5 * 2) = -5
    config = {"clip_low_threshold": 0.4, "clip_high_threshold": 2.0}
    assert close(loss("ppo", data(TARGET), inputs, config).item(), -5.0)


# -- cispo ----------------------------------------------------------------------------------------


def test_cispo_positive_advantages():
    # thresholds 0.8 / 1.2: coefficient c = clip(r) = [1, 1.2, 0.8]; advantages [1, 2, 2]
    # c * t * A = [1 * -1 * 1, 1.2 * -2 * 2, 0.8 * -0.5 * 2] = [-1, -4.8, -0.8], sum -6.6, loss 6.6
    # c is stop-gradient, so d loss / d t = -c * A = [-1, -2.4, -1.6]: clipped tokens keep a gradient
    value, grad = value_and_grad(cispo, data(SAMPLING), data([1.0, 2.0, 2.0]), 0.8, 1.2)
    assert close(value, 6.6) and close(grad, [-1.0, -2.4, -1.6])


def test_cispo_negative_advantages():
    # advantages [-1, -2, -2]: c * t * A = [1, 4.8, 0.8], sum 6.6, loss -6.6; gradient -c * A = [1, 2.4, 1.6]
    value, grad = value_and_grad(cispo, data(SAMPLING), data([-1.0, -2.0, -2.0]), 0.8, 1.2)
    assert close(value, -6.6) and close(grad, [1.0, 2.4, 1.6])


def test_cispo_defaults_clip_only_above_4():
    # defaults 0.0 / 4.0 leave ratios [1, 1.5, 0.5] alone; advantages [1, 2, 2]:
    # c * t * A = [-1, 1.5 * -2 * 2, 0.5 * -0.5 * 2] = [-1, -6, -0.5], loss 7.5
    value, grad = value_and_grad(cispo, data(SAMPLING), data([1.0, 2.0, 2.0]))
    assert close(value, 7.5) and close(grad, [-1.0, -3.0, -1.0])
    # a ratio of 5 is capped at 4: one token, t = -1, A = 1: loss = -(4 * -1 * 1) = 4, gradient -4
    target = leaf([-1.0])
    out = loss("cispo", target, {"target_tokens": [3], "logprobs": [-1.0 - math.log(5.0)], "advantages": [1.0]})
    out.backward()
    assert close(out.item(), 4.0) and close(target.grad.tolist(), [-4.0])


# -- gspo -----------------------------------------------------------------------------------------


def test_gspo_one_sequence_ratio_with_each_tokens_own_gradient():
    # mask [0, 1, 1] (token 0 is the prompt's): s = exp(mean(log 1.5, log 0.5)) = sqrt(0.75) = 0.8660,
    # the value every token's ratio takes. Thresholds 0.8 / 1.2 leave s alone; advantages [0, 2, 2]:
    # loss = -(0 + 2 s + 2 s) = -4 s = -3.4641; d s_t / d t_t = s (sg(s) * exp(t - sg(t))), so the
    # gradient is -s * A = [0, -1.7321, -1.7321]: equal, where PPO's would be -r A = [0, -3, -1]
    s = math.sqrt(0.75)
    value, grad = value_and_grad(gspo, data(SAMPLING), data([0.0, 2.0, 2.0]), data([0.0, 1.0, 1.0]), 0.8, 1.2)
    assert close(value, -4 * s) and close(grad, [0.0, -2 * s, -2 * s])


def test_gspo_clips_the_whole_sequence():
    # mask [1, 1, 0]: s = exp(mean(log 1, log 1.5)) = sqrt(1.5) = 1.2247, above 1.2; advantages [1, 1, 1]:
    # every token takes min(1.2247, 1.2) = 1.2, a constant: loss -3.6 and no gradient anywhere (token-level
    # PPO would keep tokens 0 and 2, whose own ratios are 1 and 0.5)
    value, grad = value_and_grad(gspo, data(SAMPLING), data([1.0, 1.0, 1.0]), data([1.0, 1.0, 0.0]), 0.8, 1.2)
    assert close(value, -3.6) and close(grad, [0.0, 0.0, 0.0])


def test_gspo_defaults_are_the_papers_clip_range():
    # defaults 1 - 3e-4 / 1 + 4e-4; mask [0, 1, 1]: s = sqrt(0.75) = 0.8660; advantages [0, 1, -1]
    # token 1: min(s, 0.9997) = s (gradient -s); token 2: min(-s, -0.9997) = -0.9997 (clipped: no gradient)
    # loss = -(s - 0.9997) = 0.9997 - 0.8660 = 0.1337
    s = math.sqrt(0.75)
    inputs = {**RL_INPUTS, "advantages": [0.0, 1.0, -1.0], "sequence_ratio_mask": [0.0, 1.0, 1.0]}
    target = leaf(TARGET)
    out = loss("gspo", target, inputs)
    out.backward()
    assert close(out.item(), (1 - 3e-4) - s) and close(target.grad.tolist(), [0.0, -s, 0.0])
    with pytest.raises(ValueError, match="'gspo': sequence_ratio_mask marks no position"):
        loss("gspo", data(TARGET), {**inputs, "sequence_ratio_mask": [0.0, 0.0, 0.0]})
    with pytest.raises(ValueError, match="loss 'gspo' is missing loss_fn_inputs sequence_ratio_mask"):
        loss("gspo", data(TARGET), RL_INPUTS)


# -- dro ------------------------------------------------------------------------------------------


def test_dro():
    # sampling [-1, -1.5, -1], so log(p/q) = t - s = [0, -0.5, 0.5]; advantages [2, -1, 4]; beta 0.1
    # objective_i = t_i A_i - 0.5 * 0.1 * (t_i - s_i)^2
    #   = [-2 - 0, 2 - 0.05 * 0.25, -2 - 0.05 * 0.25] = [-2, 1.9875, -2.0125], sum -2.025, loss 2.025
    # d loss / d t_i = -A_i + beta (t_i - s_i) = [-2 + 0, 1 - 0.05, -4 + 0.05] = [-2, 0.95, -3.95]
    value, grad = value_and_grad(dro, data([-1.0, -1.5, -1.0]), data([2.0, -1.0, 4.0]), beta=0.1)
    assert close(value, 2.025) and close(grad, [-2.0, 0.95, -3.95])


# -- what the gradient flows through --------------------------------------------------------------


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "cispo", "gspo", "dro"])
def test_sampler_logprobs_and_advantages_are_data(name):
    sampling, advantages = leaf(SAMPLING), leaf([1.0, -2.0, 2.0])
    target = leaf(TARGET)
    extra = {"dro": {"beta": 0.1}, "gspo": {"sequence_ratio_mask": data([1.0, 1.0, 1.0])}}.get(name, {})
    LOSSES[name](target, sampling, advantages, **extra).backward()
    assert target.grad is not None and target.grad.abs().sum() > 0
    assert sampling.grad is None and advantages.grad is None


def test_cross_entropy_weights_are_data():
    weights, target = leaf([1.0, 1.0, 1.0]), leaf(TARGET)
    cross_entropy(target, weights).backward()
    assert weights.grad is None and close(target.grad.tolist(), [-1.0, -1.0, -1.0])


def test_loss_dispatches_with_numpy_and_list_inputs():
    # the same numbers as test_importance_sampling, through the name and inputs a client sends
    inputs = {"target_tokens": np.array([4, 5, 6]), "logprobs": np.array(SAMPLING), "advantages": [2.0, -1.0, 4.0]}
    assert close(loss("importance_sampling", data(TARGET), inputs, {}).item(), -2.5)
    assert set(LOSSES) == {"cross_entropy", "importance_sampling", "ppo", "cispo", "gspo", "dro"}


# -- what loss refuses ----------------------------------------------------------------------------

RL_INPUTS = {"target_tokens": [1, 2, 3], "logprobs": SAMPLING, "advantages": [1.0, 2.0, 2.0]}


def test_unknown_loss_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown loss 'grpo'") as e:
        loss("grpo", data(TARGET), RL_INPUTS)
    assert all(name in str(e.value) for name in ["cross_entropy", "importance_sampling", "ppo", "cispo", "gspo", "dro"])


def test_missing_input_names_the_loss_the_key_and_what_it_needs():
    inputs = {k: v for k, v in RL_INPUTS.items() if k != "advantages"}
    with pytest.raises(ValueError) as e:
        loss("ppo", data(TARGET), inputs)
    assert (
        str(e.value) == "loss 'ppo' is missing loss_fn_inputs advantages; it needs: target_tokens, logprobs, advantages"
    )
    with pytest.raises(ValueError, match="loss 'cross_entropy' is missing loss_fn_inputs weights"):
        loss("cross_entropy", data(TARGET), {"target_tokens": [1, 2, 3]})


def test_unknown_config_key_lists_the_accepted_ones():
    with pytest.raises(ValueError) as e:
        loss("ppo", data(TARGET), RL_INPUTS, {"clip_epsilon": 0.2})
    assert str(e.value) == (
        "loss 'ppo' does not take loss_fn_config clip_epsilon; it accepts: clip_low_threshold, clip_high_threshold"
    )
    with pytest.raises(ValueError, match="does not take loss_fn_config beta; it accepts: none"):
        loss("importance_sampling", data(TARGET), RL_INPUTS, {"beta": 0.1})


def test_bad_config_values():
    with pytest.raises(ValueError, match="loss 'dro' needs loss_fn_config beta"):
        loss("dro", data(TARGET), RL_INPUTS)
    with pytest.raises(ValueError, match="clip_high_threshold must be a number"):
        loss("cispo", data(TARGET), RL_INPUTS, {"clip_high_threshold": "4"})
    with pytest.raises(ValueError, match="clip_low_threshold 1.5 is above clip_high_threshold 1.2"):
        loss("ppo", data(TARGET), RL_INPUTS, {"clip_low_threshold": 1.5})


def test_mismatched_shapes():
    with pytest.raises(ValueError, match=r"advantages has shape \(2,\) but target_logprobs has \(3,\)"):
        loss("ppo", data(TARGET), {**RL_INPUTS, "advantages": [1.0, 2.0]})
    with pytest.raises(ValueError, match=r"target_tokens has shape \(4,\)"):
        loss("cross_entropy", data(TARGET), {"target_tokens": [1, 2, 3, 4], "weights": [1.0, 1.0, 1.0]})
    with pytest.raises(ValueError, match="must be a 1-D torch tensor"):  # (N, K) is for cross_entropy only
        loss("ppo", data([TARGET, TARGET]), RL_INPUTS)
    with pytest.raises(ValueError, match=r"weights has shape \(1, 3\)"):  # no silent broadcasting, called directly
        cross_entropy(data(TARGET), data([[1.0, 1.0, 1.0]]))


def test_the_module_keeps_its_tables_in_step():
    assert set(losses.INPUTS) == set(LOSSES) == set(losses.CONFIG) == set(losses.NDIMS)
    # loss() fills in CONFIG's defaults; a direct call gets the signature's: they must be the same
    for name, fn in LOSSES.items():
        params = inspect.signature(fn).parameters
        defaults = {
            k: None if p.default is p.empty else p.default for k, p in params.items() if k in losses.CONFIG[name]
        }
        assert defaults == losses.CONFIG[name], name
