"""The policy objective that ``grpo`` and ``ppo`` share: the loss of a minibatch, term by term.

Per minibatch, with ``agg`` the algorithm's :class:`~hybridrl.functional.LossAggregation`:

    loss = agg(w L) - entropy_coeff agg(H) + kl_coef agg(KL(pi, pi_ref))

- L (B, T): the surrogate, by default PPO's clipped loss with dual clip
  (:func:`hybridrl.functional.policy_loss`; Schulman et al. 2017, arXiv:1707.06347; dual clip,
  Ye et al. 2020, arXiv:1912.09729; verl's ``compute_policy_loss`` in ``core_algos.py``). An
  algorithm with another surrogate overrides :meth:`PolicyObjective.surrogate` (``grpo``'s GSPO).
- w (B, T): the off-policy correction weights (:func:`hybridrl.correction.rollout_correction`),
  1 when it is off; they weigh the surrogate only, not the entropy or KL terms (as verl and TRL).
- H (B, T): the token entropy of pi; KL: :func:`hybridrl.functional.kl_penalty` of ``kl_kind``.
  A term whose coefficient is 0 is not computed (no reference logprobs needed, no metric logged).

This is verl's actor loss (``dp_actor.update_policy``: ``pg_loss - entropy_coeff * entropy_loss +
kl_loss * kl_loss_coef``, each term aggregated with ``loss_agg_mode``). docs/algorithms.md gives
the formulas and the metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from pydantic import Field

from hybridrl import functional as F
from hybridrl.correction import RolloutCorrectionOptions, rollout_correction

if TYPE_CHECKING:
    from hybridrl.batch import Batch


class PolicyLossOptions(RolloutCorrectionOptions):
    """The policy-loss options that ``grpo`` and ``ppo`` share (their ``Options`` inherit them), with
    the off-policy correction's. The clip range and the KL term stay with each algorithm: their
    defaults and YAML keys differ."""

    clip_c: float = Field(
        3.0,
        gt=1,
        description="Dual-clip bound for negative advantages: a token's clipped loss is at most -A x clip_c "
        "(grpo's policy_loss gspo has no dual clip).",
    )
    entropy_coeff: float = Field(0.0, ge=0, description="Entropy bonus: the loss subtracts this x entropy.")
    loss_norm_length: int | None = Field(
        None,
        gt=0,
        description="seq-mean-token-sum-norm (Dr. GRPO): the constant L of sum(m l) / (responses x L), for every "
        "loss of the algorithm in that mode (ppo: the value loss too); default rollout.max_tokens.",
    )

    def aggregation(self, mode: str, ctx) -> F.LossAggregation:
        """The aggregation of ``mode``, its constant length ``loss_norm_length`` or else the run's
        longest response (``ctx.response_tokens``; none without a run context)."""
        return F.LossAggregation(mode, self.loss_norm_length or (ctx.response_tokens if ctx is not None else None))


@dataclass(frozen=True)
class PolicyObjective:
    """``objective(batch, logprobs, entropy) -> (loss, metrics)``: an algorithm's ``loss``.

    Invariants: the surrogate, entropy and KL terms use the same ``aggregation`` (whose normaliser
    the trainer weighs micro-batches and ranks with); the metrics are plain floats apart from the
    ``rollout_corr/*`` ones (tensors, reduced by the update loop), and their names do not depend on
    the settings except the KL term's, ``kl_metric`` (``actor/kl`` in ``grpo``, ``actor/kl_loss``
    in ``ppo``).
    """

    aggregation: F.LossAggregation
    clip_low: float = 0.2  # ratio clip below: 1 - clip_low
    clip_high: float = 0.2  # ratio clip above: 1 + clip_high (DAPO's clip-higher: 0.28)
    clip_c: float = 3.0  # dual clip: the token loss of A < 0 is at most -A clip_c
    entropy_coeff: float = 0.0
    kl_coef: float = 0.0  # 0: no KL term, no reference logprobs needed
    kl_kind: str = "k3"
    kl_metric: str = "actor/kl"
    correction: RolloutCorrectionOptions = field(default_factory=RolloutCorrectionOptions)

    def __post_init__(self):
        if self.kl_coef > 0:
            F.check_kl_loss_kind(self.kl_kind)

    @classmethod
    def from_options(cls, options: PolicyLossOptions, aggregation: F.LossAggregation, **settings) -> PolicyObjective:
        """The objective of an algorithm's options: ``clip_c``, ``entropy_coeff`` and the correction
        from them, the rest (clip range, KL term) as ``settings``."""
        return cls(
            aggregation, clip_c=options.clip_c, entropy_coeff=options.entropy_coeff, correction=options, **settings
        )

    @property
    def needs_reference(self) -> bool:
        """Whether the batch must hold ``ref_logprobs``: a KL term."""
        return self.kl_coef > 0

    @property
    def needs_entropy_grad(self) -> bool:
        """Whether ``entropy`` must carry gradients: an entropy bonus."""
        return self.entropy_coeff > 0

    def surrogate(
        self,
        old_logp: torch.Tensor,  # (B, T) logprobs under the policy that sampled
        logp: torch.Tensor,  # (B, T) logprobs under the current policy, with grad
        advantages: torch.Tensor,  # (B, T)
        mask: torch.Tensor,  # (B, T) response mask
        weights: torch.Tensor | None,  # (B, T) detached correction weights; None: all 1
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """agg(w L) with L PPO's clipped token loss with dual clip, and its ``clipfrac``,
        ``clipfrac_lower`` and ``ppo_kl`` (unweighted)."""
        return F.policy_loss(
            old_logp,
            logp,
            advantages,
            mask,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            clip_c=self.clip_c,
            agg_mode=self.aggregation,
            token_weights=weights,
        )

    def __call__(
        self,
        batch: Batch,  # old_logprobs, advantages, response_mask (B, T); ref_logprobs with a KL term
        logprobs: torch.Tensor,  # (B, T) with grad
        entropy: torch.Tensor,  # (B, T) with grad when needs_entropy_grad
    ) -> tuple[torch.Tensor, dict]:
        """The loss and its metrics: ``actor/pg_loss`` and the surrogate's under ``actor/``, the
        correction's ``rollout_corr/*``, ``actor/entropy_loss`` and ``kl_metric`` when their terms exist."""
        mask = batch["response_mask"]
        weights, corrected = rollout_correction(batch, self.correction)  # None unless a correction is on
        loss, m = self.surrogate(batch["old_logprobs"], logprobs, batch["advantages"], mask, weights)
        metrics = {f"actor/{k}": v.item() for k, v in m.items()} | corrected
        metrics["actor/pg_loss"] = loss.item()
        if self.entropy_coeff > 0:
            ent = self.aggregation(entropy, mask)
            loss = loss - self.entropy_coeff * ent
            metrics["actor/entropy_loss"] = ent.item()
        if self.kl_coef > 0:
            kl = self.aggregation(F.kl_penalty(logprobs, batch["ref_logprobs"], self.kl_kind), mask)
            loss = loss + self.kl_coef * kl
            metrics[self.kl_metric] = kl.item()
        return loss, metrics
