"""The built-in losses of Tinker's ``forward_backward``, as pure functions on the tensors of one datum.

Each function takes ``target_logprobs``, the logprobs of the datum's ``target_tokens`` under the
weights being trained (what the server computes in the forward pass), and the datum's
``loss_fn_inputs`` aligned with it position by position, and returns the scalar loss as Tinker
defines it: the token losses summed over the datum, never averaged. The gradient flows through
``target_logprobs`` alone: the sampler's logprobs, the advantages and the weights are data.

Source of every formula: https://tinker-docs.thinkingmachines.ai/losses (the page that the Tinker
Cookbook's ``rl/train.py`` cites) and its per-loss pages under
https://tinker-docs.thinkingmachines.ai/tinker/losses/. ``stable_reinforce`` is not here: Tinker
publishes no formula for it (docs/tinker.md).

:func:`loss` is the entry a server calls: it looks the loss up by the name the client sent, checks
the datum's inputs and the request's ``loss_fn_config``, and fills in the documented defaults.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


def _check_shapes(name: str, target_logprobs: torch.Tensor, **tensors: torch.Tensor) -> None:
    """Every input has the shape of ``target_logprobs``: no silent broadcasting across positions."""
    if not isinstance(target_logprobs, torch.Tensor) or not target_logprobs.is_floating_point():
        raise ValueError(f"loss {name!r}: target_logprobs must be a floating-point torch tensor")
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"loss {name!r}: {key} must be a torch tensor, got {type(value).__name__}")
        if value.shape != target_logprobs.shape:
            raise ValueError(
                f"loss {name!r}: {key} has shape {tuple(value.shape)} but target_logprobs has "
                f"{tuple(target_logprobs.shape)}; every loss_fn_input is aligned with the target positions"
            )


def _ratio(target_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor) -> torch.Tensor:
    """p_theta(x) / q(x) per token, with the sampler's logprobs as data."""
    return torch.exp(target_logprobs - sampling_logprobs.detach())


def _check_thresholds(name: str, clip_low_threshold: float, clip_high_threshold: float) -> None:
    if clip_low_threshold > clip_high_threshold:
        raise ValueError(
            f"loss {name!r}: clip_low_threshold {clip_low_threshold} is above clip_high_threshold {clip_high_threshold}"
        )


def cross_entropy(target_logprobs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted negative log-likelihood: ``-sum_t w_t * log p_theta(x_t)``.

    Source: https://tinker-docs.thinkingmachines.ai/losses and
    https://tinker-docs.thinkingmachines.ai/tinker/losses/cross-entropy. ``weights`` may be any floats,
    negative ones included (the SDK's ``forward_backward_custom`` sends ``weights = -dLoss/dlogprobs``).
    Shapes ``(N,)`` and, for top-K distillation, ``(N, K)``: the sum runs over every element.
    """
    _check_shapes("cross_entropy", target_logprobs, weights=weights)
    return -(target_logprobs * weights.detach()).sum()


def importance_sampling(
    target_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, advantages: torch.Tensor
) -> torch.Tensor:
    """REINFORCE with an importance ratio: ``-sum_t (p_theta(x_t) / q(x_t)) * A_t``.

    Source: https://tinker-docs.thinkingmachines.ai/losses (section importance_sampling).
    ``sampling_logprobs`` is the datum's ``logprobs`` input (log q, recorded by the sampler).
    """
    _check_shapes("importance_sampling", target_logprobs, logprobs=sampling_logprobs, advantages=advantages)
    return -(_ratio(target_logprobs, sampling_logprobs) * advantages.detach()).sum()


def ppo(
    target_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low_threshold: float = 0.8,
    clip_high_threshold: float = 1.2,
) -> torch.Tensor:
    """Token-wise clipped PPO: ``-sum_t min(r_t * A_t, clip(r_t, low, high) * A_t)``, ``r_t = p_theta / q``.

    Source: https://tinker-docs.thinkingmachines.ai/tinker/losses/ppo (and /losses). The thresholds
    bound the ratio itself, not epsilon; the docs fix epsilon_low = epsilon_high = 0.2, so the
    defaults are 1 - 0.2 and 1 + 0.2. A token whose clipped term is the smaller one gets no gradient.
    """
    _check_shapes("ppo", target_logprobs, logprobs=sampling_logprobs, advantages=advantages)
    _check_thresholds("ppo", clip_low_threshold, clip_high_threshold)
    ratio, advantages = _ratio(target_logprobs, sampling_logprobs), advantages.detach()
    clipped = torch.clamp(ratio, clip_low_threshold, clip_high_threshold)
    return -torch.minimum(ratio * advantages, clipped * advantages).sum()


def cispo(
    target_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low_threshold: float = 0.0,
    clip_high_threshold: float = 4.0,
) -> torch.Tensor:
    """Clipped-ratio policy gradient: ``-sum_t sg(clip(r_t, low, high)) * log p_theta(x_t) * A_t``.

    Source: https://tinker-docs.thinkingmachines.ai/tinker/losses/cispo. The clipped ratio is a
    stop-gradient coefficient, so every token keeps a gradient (``-sg(clip(r_t)) * A_t``). Defaults:
    the docs' one-sided clip, no lower bound (0.0) and an upper one of 4.0.
    """
    _check_shapes("cispo", target_logprobs, logprobs=sampling_logprobs, advantages=advantages)
    _check_thresholds("cispo", clip_low_threshold, clip_high_threshold)
    coefficient = torch.clamp(_ratio(target_logprobs, sampling_logprobs), clip_low_threshold, clip_high_threshold)
    return -(coefficient.detach() * target_logprobs * advantages.detach()).sum()


# GSPO's clip range from its paper (Zheng et al., 2025, arXiv:2507.18071, its experiments: "3e-4 and
# 4e-4"), as bounds on the ratio; Tinker's GSPO page gives the formula but no default
GSPO_LOW, GSPO_HIGH = 1.0 - 3e-4, 1.0 + 4e-4


def gspo(
    target_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    sequence_ratio_mask: torch.Tensor,
    clip_low_threshold: float = GSPO_LOW,
    clip_high_threshold: float = GSPO_HIGH,
) -> torch.Tensor:
    """GSPO-token: ``-sum_t min(s_t * A_t, clip(s_t, low, high) * A_t)``.

    Source: https://tinker-docs.thinkingmachines.ai/tinker/losses/gspo. ``s`` is the geometric mean of
    the token ratios over the positions ``sequence_ratio_mask`` marks, ``exp(mean_M(log p_theta -
    log q))``; each token's ``s_t = sg(s) * p_theta(x_t) / sg(p_theta(x_t))`` takes ``s``'s value and
    its own logprob's gradient, so per-token advantages still work. The sum runs over every position
    (the advantages are 0 where nothing is trained).
    """
    _check_shapes("gspo", target_logprobs, logprobs=sampling_logprobs, advantages=advantages,
                  sequence_ratio_mask=sequence_ratio_mask)  # fmt: skip
    _check_thresholds("gspo", clip_low_threshold, clip_high_threshold)
    in_ratio = sequence_ratio_mask != 0
    if not bool(in_ratio.any()):
        raise ValueError("loss 'gspo': sequence_ratio_mask marks no position; mark the sampled tokens with 1")
    log_ratio = (target_logprobs.detach() - sampling_logprobs.detach())[in_ratio].mean()
    ratio = torch.exp(log_ratio + target_logprobs - target_logprobs.detach())
    clipped = torch.clamp(ratio, clip_low_threshold, clip_high_threshold)
    advantages = advantages.detach()
    return -torch.minimum(ratio * advantages, clipped * advantages).sum()


def dro(
    target_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, advantages: torch.Tensor, beta: float
) -> torch.Tensor:
    """Direct reward optimization: ``-sum_t (log p_theta(x_t) * A_t - beta / 2 * (log p_theta(x_t) - log q(x_t))^2)``.

    Source: https://tinker-docs.thinkingmachines.ai/tinker/losses/dro (and /losses). The docs give no
    default for ``beta``, so it has none here: :func:`loss` asks for it in ``loss_fn_config``.
    """
    _check_shapes("dro", target_logprobs, logprobs=sampling_logprobs, advantages=advantages)
    log_ratio = target_logprobs - sampling_logprobs.detach()
    return -(target_logprobs * advantages.detach() - 0.5 * beta * log_ratio**2).sum()


LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "gspo": gspo,
    "dro": dro,
}

# The loss_fn_inputs each loss needs, as the docs list them; after target_tokens (which the server
# turns into target_logprobs) the rest are the function's tensor arguments in order.
INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "gspo": ("target_tokens", "logprobs", "advantages", "sequence_ratio_mask"),
    "dro": ("target_tokens", "logprobs", "advantages"),
}

# The loss_fn_config keys each loss accepts, with their defaults (None: required, no documented default).
CONFIG: dict[str, dict[str, float | None]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "gspo": {"clip_low_threshold": GSPO_LOW, "clip_high_threshold": GSPO_HIGH},
    "dro": {"beta": None},
}

# the shapes the docs allow: (N,) everywhere, (N, K) for cross_entropy's top-K distillation
NDIMS: dict[str, tuple[int, ...]] = {name: (1, 2) if name == "cross_entropy" else (1,) for name in LOSSES}


def _options(name: str, config: Mapping[str, Any]) -> dict[str, float]:
    """The loss's keyword arguments: the request's loss_fn_config over the documented defaults."""
    accepted = CONFIG[name]
    unknown = sorted(set(config) - set(accepted))
    if unknown:
        takes = ", ".join(accepted) if accepted else "none"
        raise ValueError(f"loss {name!r} does not take loss_fn_config {', '.join(unknown)}; it accepts: {takes}")
    options = {}
    for key, default in accepted.items():
        value = config.get(key, default)
        if value is None:
            raise ValueError(f"loss {name!r} needs loss_fn_config {key}: the Tinker docs give it no default")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"loss {name!r}: loss_fn_config {key} must be a number, got {value!r}")
        options[key] = float(value)
    return options


# Tinker's losses this server does not compute, and why (docs/tinker.md)
NOT_SERVED = {
    "stable_reinforce": "Tinker publishes no formula for it (the cookbook's rl_loop takes loss_fn=importance_sampling)",
    "custom": "server-side custom losses are not served (forward_backward_custom runs on the client)",
}


def loss(
    name: str, target_logprobs: torch.Tensor, inputs: Mapping[str, Any], config: Mapping[str, Any] | None = None
) -> torch.Tensor:
    """The loss ``name`` of one datum: ``inputs`` is its loss_fn_inputs, ``config`` the request's loss_fn_config.

    Checks what the client sent before computing: the loss name, the inputs the loss needs (other
    keys are left alone), the config keys it accepts, and that every input has the shape of
    ``target_logprobs``; each failure is a ValueError that says what to send instead. Inputs may be
    tensors, numpy arrays or lists; float inputs take ``target_logprobs``' dtype and device.
    """
    if name in NOT_SERVED:
        raise ValueError(f"loss {name!r} is not served here: {NOT_SERVED[name]}; served: {', '.join(LOSSES)}")
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; the built-in losses are: {', '.join(LOSSES)}")
    needed = INPUTS[name]
    missing = [key for key in needed if key not in inputs]
    if missing:
        raise ValueError(f"loss {name!r} is missing loss_fn_inputs {', '.join(missing)}; it needs: {', '.join(needed)}")
    options = _options(name, config or {})
    if not isinstance(target_logprobs, torch.Tensor) or target_logprobs.dim() not in NDIMS[name]:
        shapes = " or ".join(f"{n}-D" for n in NDIMS[name])
        got = tuple(target_logprobs.shape) if isinstance(target_logprobs, torch.Tensor) else type(target_logprobs)
        raise ValueError(f"loss {name!r}: target_logprobs must be a {shapes} torch tensor, got {got}")
    target_tokens = torch.as_tensor(inputs["target_tokens"])
    _check_shapes(name, target_logprobs, target_tokens=target_tokens)
    tensors = [
        torch.as_tensor(inputs[key], dtype=target_logprobs.dtype, device=target_logprobs.device) for key in needed[1:]
    ]
    return LOSSES[name](target_logprobs, *tensors, **options)
