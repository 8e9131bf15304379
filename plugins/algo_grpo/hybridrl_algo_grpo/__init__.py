"""GRPO for hybridrl: group-relative advantages and the clipped policy loss."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hybridrl import functional as F
from hybridrl.components import Algorithm, Options
from hybridrl.hookspecs import hookimpl
from hybridrl_algo_grpo.functional import group_advantages


class GRPO(Algorithm):
    class Options(Options):
        clip_low: float = Field(0.2, ge=0, description="Ratio clip below: 1 - clip_low.")
        clip_high: float = Field(0.2, ge=0, description="Ratio clip above: 1 + clip_high (DAPO clip-higher: 0.28).")
        clip_c: float = Field(3.0, gt=1, description="Dual-clip bound for negative advantages.")
        norm_adv_by_std: bool = Field(True, description="Divide by the group std (False: Dr. GRPO).")
        eps: float = Field(1e-6, gt=0)
        kl_coef: float = Field(
            0.0, ge=0, description="KL-to-reference loss coefficient (beta); 0 loads no reference model."
        )
        kl_kind: Literal["k1", "abs", "k2", "k3"] = Field("k3", description="KL estimator of the KL loss.")
        loss_agg_mode: Literal[F.AGG_MODES] = Field("token-mean", description="Token aggregation of the loss.")

    @property
    def loss_agg_mode(self) -> str:
        return self.options.loss_agg_mode

    @property
    def needs_reference(self) -> bool:
        return self.options.kl_coef > 0

    def compute_advantages(self, batch):
        o = self.options
        batch["advantages"] = group_advantages(
            batch["scores"].to(batch["response_mask"].device),
            batch["response_mask"],
            batch["group_ids"],
            norm_std=o.norm_adv_by_std,
            eps=o.eps,
        )
        return {}

    def loss(self, batch, logprobs, entropy):
        o = self.options
        mask = batch["response_mask"]
        loss, m = F.policy_loss(
            batch["old_logprobs"],
            logprobs,
            batch["advantages"],
            mask,
            clip_low=o.clip_low,
            clip_high=o.clip_high,
            clip_c=o.clip_c,
            agg_mode=o.loss_agg_mode,
        )
        metrics = {
            "actor/pg_loss": loss.item(),
            "actor/clipfrac": m["clipfrac"].item(),
            "actor/clipfrac_lower": m["clipfrac_lower"].item(),
            "actor/ppo_kl": m["ppo_kl"].item(),
        }
        if o.kl_coef > 0:
            kl = F.agg_loss(F.kl_penalty(logprobs, batch["ref_logprobs"], o.kl_kind), mask, o.loss_agg_mode)
            loss = loss + o.kl_coef * kl
            metrics["actor/kl"] = kl.item()
        return loss, metrics


@hookimpl
def register_algorithms(register):
    register("grpo", GRPO)
