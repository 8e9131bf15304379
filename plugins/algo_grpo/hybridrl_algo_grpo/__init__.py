"""GRPO and its critic-free relatives for hybridrl.

One algorithm, ``grpo``, whose options choose the advantage estimator (GRPO, Dr. GRPO, RLOO,
REINFORCE++, REINFORCE++-baseline), the policy loss (PPO-clip with dual clip and asymmetric
DAPO clip-higher, or GSPO's sequence-level ratio), the aggregation, a KL-to-reference loss,
an entropy bonus, and DAPO's dynamic sampling and soft overlong punishment.
docs/algorithms.md gives every option's formula.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, ValidationInfo, field_validator

from hybridrl import distributed
from hybridrl import functional as F
from hybridrl.components import Algorithm
from hybridrl.hookspecs import hookimpl
from hybridrl.objective import PolicyLossOptions, PolicyObjective
from hybridrl_algo_grpo.functional import (
    group_advantages,
    gspo_policy_loss,
    overlong_penalty,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    varied_groups,
)

ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
# per policy loss: (clip_low, clip_high, loss_agg_mode) when not set
LOSS_DEFAULTS = {"vanilla": (0.2, 0.2, "token-mean"), "gspo": (3e-4, 4e-4, "seq-mean-token-mean")}


class GSPOObjective(PolicyObjective):
    """The shared objective with GSPO's sequence-level ratio as its surrogate (no dual clip)."""

    def surrogate(self, old_logp, logp, advantages, mask, weights):  # all (B, T)
        return gspo_policy_loss(
            old_logp, logp, advantages, mask, self.clip_low, self.clip_high, self.aggregation, weights
        )


class GRPO(Algorithm):
    class Options(PolicyLossOptions):
        estimator: Literal[ESTIMATORS] = Field(
            "grpo",
            description="Advantage estimator: grpo (group mean/std), rloo (leave-one-out mean), "
            "reinforce_plus_plus (token returns whitened over the batch), "
            "reinforce_plus_plus_baseline (group mean subtracted, then whitened).",
        )
        norm_adv_by_std: bool = Field(True, description="grpo: divide by the group std (False: Dr. GRPO).")
        eps: float = Field(1e-6, gt=0, description="grpo: added to the group std.")
        gamma: float = Field(1.0, ge=0, le=1, description="reinforce_plus_plus: discount of the token returns.")
        policy_loss: Literal["vanilla", "gspo"] = Field(
            "vanilla",
            description="vanilla: token-level PPO clip (dual clip for A < 0); gspo: sequence-level "
            "importance ratio (GSPO, arXiv:2507.18071).",
        )
        clip_low: float | None = Field(
            None, ge=0, description="Ratio clip below: 1 - clip_low. Default 0.2 (vanilla), 3e-4 (gspo)."
        )
        clip_high: float | None = Field(
            None,
            ge=0,
            description="Ratio clip above: 1 + clip_high (DAPO clip-higher: 0.28). Default 0.2 (vanilla), 4e-4 (gspo).",
        )
        kl_coef: float = Field(
            0.0, ge=0, description="KL-to-reference loss coefficient (beta); 0 loads no reference model."
        )
        kl_kind: Literal[F.KL_KINDS] = Field(
            "k3",
            description="KL estimator of the KL loss: k3 (verl's low_var_kl) or k2. k1 and abs are refused: "
            "on-policy their gradient does not pull towards the reference (docs/algorithms.md).",
        )
        loss_agg_mode: Literal[F.AGG_MODES] | None = Field(
            None,
            description="Token aggregation of the loss. Default token-mean (vanilla), seq-mean-token-mean (gspo).",
        )
        dynamic_sampling: bool = Field(
            False, description="DAPO: drop the groups whose rewards are all equal before the update."
        )
        overlong_buffer_len: int = Field(
            0, ge=0, description="DAPO soft overlong punishment: buffer length in tokens (0: off)."
        )
        overlong_penalty_factor: float = Field(
            1.0, ge=0, description="DAPO soft overlong punishment: the penalty at the maximum length."
        )
        overlong_max_length: int | None = Field(
            None,
            validate_default=True,
            description="DAPO soft overlong punishment: the maximum response length (set it to rollout.max_tokens).",
        )

        @field_validator("kl_kind")
        @classmethod
        def _kl_loss_kind(cls, v: str) -> str:
            return F.check_kl_loss_kind(v)

        @field_validator("overlong_max_length")
        @classmethod
        def _overlong_needs_max(cls, v: int | None, info: ValidationInfo) -> int | None:
            buffer = info.data.get("overlong_buffer_len") or 0
            if buffer and v is None:
                raise ValueError(
                    f"overlong_buffer_len={buffer} needs overlong_max_length: set it to rollout.max_tokens"
                )
            if buffer and v <= buffer:
                raise ValueError(f"must be larger than overlong_buffer_len={buffer}")
            return v

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        o = options
        low, high, agg = LOSS_DEFAULTS[o.policy_loss]
        self.clip_low = low if o.clip_low is None else o.clip_low
        self.clip_high = high if o.clip_high is None else o.clip_high
        objective = GSPOObjective if o.policy_loss == "gspo" else PolicyObjective
        self.objective = objective.from_options(
            o,
            o.aggregation(o.loss_agg_mode or agg, ctx),
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            kl_coef=o.kl_coef,
            kl_kind=o.kl_kind,
            kl_metric="actor/kl",
        )
        self.loss_aggregation = self.objective.aggregation

    @property
    def loss_agg_mode(self) -> str:
        return self.loss_aggregation.mode

    @property
    def needs_reference(self) -> bool:
        return self.objective.needs_reference

    @property
    def needs_entropy_grad(self) -> bool:
        return self.objective.needs_entropy_grad

    def filter_batch(self, batch):
        """DAPO dynamic sampling: the rows of the groups whose rewards vary (none when every group's
        are equal) and the ``dynamic_sampling/*`` metrics of this batch."""
        if not self.options.dynamic_sampling or len(batch) == 0:
            return batch, {}
        keep = varied_groups(batch["scores"], batch["group_ids"])
        groups = torch.unique(batch["group_ids"]).numel()
        kept = torch.unique(batch["group_ids"][keep]).numel()
        metrics = {
            "dynamic_sampling/kept_groups": float(kept),
            "dynamic_sampling/kept_fraction": kept / max(groups, 1),
        }
        return batch.select(torch.nonzero(keep).squeeze(-1)), metrics

    def compute_advantages(self, batch):
        o = self.options
        metrics = {}
        mask = batch["response_mask"]
        scores = batch["scores"].to(mask.device).float()
        if o.overlong_buffer_len:
            penalty = overlong_penalty(
                mask.sum(-1), o.overlong_max_length, o.overlong_buffer_len, o.overlong_penalty_factor
            )
            scores = scores + penalty
            batch["overlong_penalty"] = penalty
            if len(batch):
                metrics["reward/overlong_penalty_mean"] = penalty.mean().item()
                metrics["reward/overlong_fraction"] = (penalty < 0).float().mean().item()
        groups, counted = batch["group_ids"].to(mask.device), F.counted_rows(batch)  # each episode once
        mean_var = distributed.masked_mean_var if distributed.world_size() > 1 else None  # whiten over all ranks
        if o.estimator == "grpo":
            adv = group_advantages(scores, mask, groups, norm_std=o.norm_adv_by_std, eps=o.eps, counted=counted)
        elif o.estimator == "rloo":
            adv = rloo_advantages(scores, mask, groups, counted)
        elif o.estimator == "reinforce_plus_plus":
            adv, _ = reinforce_pp_advantages(scores, mask, o.gamma, mean_var)
        else:
            adv = reinforce_pp_baseline_advantages(scores, mask, groups, mean_var, counted)
        batch["advantages"] = adv
        return metrics

    def loss(self, batch, logprobs, entropy):
        """The shared policy objective (:mod:`hybridrl.objective`; GSPO's with ``policy_loss: gspo``),
        its KL term logged as ``actor/kl``."""
        return self.objective(batch, logprobs, entropy)


@hookimpl
def register_algorithms(register):
    register("grpo", GRPO)
