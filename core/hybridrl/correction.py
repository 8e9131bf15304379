"""Off-policy correction from the rollout engine's logprobs: the options ``grpo`` and ``ppo`` share,
and the per-token weights of their policy loss.

An engine never samples exactly from the policy being trained (bfloat16 kernels, a truncated
distribution, weights a few updates old). The batch holds the engine's logprob of each sampled
token (``rollout_logprobs``) and the trainer's (``old_logprobs``); their ratio pi_old / pi_rollout
corrects the policy gradient (truncated importance sampling) or drops the tokens or responses it
marks as too far off (masking). The math is in :mod:`hybridrl.functional`; docs/algorithms.md
("Off-policy correction") gives the formulas and their sources.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from pydantic import Field, field_validator

from hybridrl import functional as F
from hybridrl.components import Options

if TYPE_CHECKING:
    from hybridrl.batch import Batch

LEVEL = Literal["off", "token", "sequence", "geometric"]


class RolloutCorrectionOptions(Options):
    """The off-policy correction options of an algorithm; its ``Options`` inherit them."""

    rollout_correction: LEVEL = Field(
        "off",
        description="Truncated importance sampling of the policy loss by pi_old / pi_rollout: token (TIS, "
        "min(ratio_t, C)), sequence (min(prod_t ratio_t, C) per response), geometric (min(exp(mean_t log "
        "ratio_t), C) per response), off.",
    )
    rollout_correction_cap: float = Field(
        2.0, description="The truncation C of rollout_correction (> 1); TIS and verl's rollout_is_threshold: 2."
    )
    rollout_mask: LEVEL = Field(
        "off",
        description="Drop from the policy loss the tokens (token, IcePop) or whole responses (sequence: their "
        "product of ratios; geometric: its geometric mean) whose ratio pi_old / pi_rollout lies outside "
        "[rollout_mask_low, rollout_mask_high]; off.",
    )
    rollout_mask_low: float = Field(0.5, description="rollout_mask: the lowest ratio kept, in (0, 1); IcePop: 0.5.")
    rollout_mask_high: float = Field(5.0, description="rollout_mask: the highest ratio kept, > 1; IcePop: 5.")

    @field_validator("rollout_correction_cap")
    @classmethod
    def _cap_above_one(cls, v: float) -> float:
        if not v > 1:
            raise ValueError(
                "must be above 1: the weights are min(ratio, cap), and a cap of 1 or less would also shrink the "
                "tokens the engine sampled exactly as the trainer scores them (ratio 1). TIS uses 2."
            )
        return v

    @field_validator("rollout_mask_low")
    @classmethod
    def _low_below_one(cls, v: float) -> float:
        if not 0 < v < 1:
            raise ValueError(
                "must be between 0 and 1: ratios below it are masked, and a ratio of 1 (no mismatch) must be "
                "kept. IcePop uses 0.5."
            )
        return v

    @field_validator("rollout_mask_high")
    @classmethod
    def _high_above_one(cls, v: float) -> float:
        if not v > 1:
            raise ValueError(
                "must be above 1: ratios above it are masked, and a ratio of 1 (no mismatch) must be kept. "
                "IcePop uses 5."
            )
        return v


def rollout_correction(batch: Batch, options: RolloutCorrectionOptions) -> tuple[torch.Tensor | None, dict]:
    """The weights (B, T) of the policy loss's tokens and their ``rollout_corr/*`` metrics (tensors).

    None and no metrics when both ``rollout_correction`` and ``rollout_mask`` are off, or when the
    batch has no ``rollout_logprobs`` (an engine that reports none): the loss is then unchanged.
    With both on, a kept token has its truncated weight, a masked one 0. Holes and padding get 0.
    """
    o = options
    if (o.rollout_correction == "off" and o.rollout_mask == "off") or "rollout_logprobs" not in batch:
        return None, {}
    old = batch["old_logprobs"]
    rollout, mask = batch["rollout_logprobs"].to(old.device), batch["response_mask"].to(old.device)
    weights, truncated, keep = mask.float(), None, None
    if o.rollout_correction != "off":
        weights, truncated = F.truncated_is_weights(old, rollout, mask, o.rollout_correction, o.rollout_correction_cap)
    if o.rollout_mask != "off":
        keep = F.rollout_ratio_mask(old, rollout, mask, o.rollout_mask, o.rollout_mask_low, o.rollout_mask_high)
        weights = weights * keep
    return weights, F.rollout_correction_metrics(old, rollout, mask, weights, truncated, keep)
