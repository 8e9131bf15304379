"""Shared RL math: small pure functions on tensors.

Shapes: B = responses in the batch, T = response length (padded). ``mask`` is a (B, T) float
or bool tensor, 1 on real response tokens. Conventions follow volcengine/verl's
``trainer/ppo/core_algos.py`` so that numbers are comparable across frameworks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "abs", "k2", "k3")
KL_LOSS_KINDS = ("k2", "k3")  # estimators whose gradient, on-policy, pulls the policy towards the reference


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    return (values * mask).sum() if dim is None else (values * mask).sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1; 0 when the mask is empty."""
    return masked_sum(values, mask, dim) / mask.sum(dim).clamp(min=1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n <= 1:
            raise ValueError("masked_var: at least two unmasked values are needed for the unbiased variance")
        var = var * n / (n - 1)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) over the mask, unbiased variance."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


@dataclass(frozen=True)
class LossAggregation:
    """How a (B, T) token loss becomes a scalar (``loss_agg_mode``), and what it divides by.

    Every mode is a masked sum divided by a normaliser; ``normaliser`` says which, so that the
    trainer can weigh micro-batches and ranks to get the loss of the whole mini-batch:

    - ``token-mean``: sum_i sum_t m l / sum_i sum_t m (tokens);
    - ``seq-mean-token-sum``: sum_i sum_t m l / N (responses);
    - ``seq-mean-token-mean``: sum_i (sum_t m l / sum_t m) / N;
    - ``seq-mean-token-sum-norm``: sum_i sum_t m l / (N x L), L a constant (Dr. GRPO, Liu et al. 2025,
      arXiv:2503.20783; TRL's ``dr_grpo`` divides by the responses times ``max_completion_length``).
      ``norm_length`` is L; the trainer sets it to ``rollout.max_tokens`` unless the algorithm's
      options give one; left unset it is the padded width T (verl's ``agg_loss`` default).
    """

    mode: str = "token-mean"
    norm_length: int | None = None

    def __post_init__(self):
        if self.mode not in AGG_MODES:
            raise ValueError(f"Unknown loss aggregation mode '{self.mode}'. Available: {', '.join(AGG_MODES)}.")

    def __call__(self, loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, T) loss and mask -> the scalar loss of these rows."""
        mask = mask.to(loss.dtype)
        if self.mode == "seq-mean-token-mean":
            numerator = ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1e-8)).sum()
        else:
            numerator = (loss * mask).sum()
        return numerator / max(self.normaliser(mask), 1e-8)

    def normaliser(self, mask: torch.Tensor, rows: int | None = None) -> float:
        """What the loss of ``mask``'s rows is divided by: tokens, responses, or responses x L.

        ``rows``: the responses to count, when some rows of ``mask`` are padding rows (empty masks
        that count as no response); default all of them.
        """
        if self.mode == "token-mean":
            return float(mask.sum())
        rows = mask.shape[0] if rows is None else rows
        if self.mode == "seq-mean-token-sum-norm":
            return float(rows * (self.norm_length or mask.shape[-1]))
        return float(rows)


def agg_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str | LossAggregation = "token-mean") -> torch.Tensor:
    """Reduce a (B, T) loss to a scalar with a :class:`LossAggregation` (or its mode's name)."""
    return (mode if isinstance(mode, LossAggregation) else LossAggregation(mode))(loss, mask)


def check_kl_loss_kind(kind: str) -> str:
    """``kind`` if its gradient as a loss term regularises towards the reference, else an error saying why.

    With x = log pi - log pi_ref and tokens sampled from pi (on-policy), the expected gradient of
    k1 = x is E[grad log pi] = 0: it adds noise and no pull; abs = |x| gives sign(x) grad log pi,
    which is not the gradient of any divergence. k2 = x^2 / 2 has the expected gradient of
    KL(pi || pi_ref) and k3 that of KL(pi_ref || pi) (Tang & Munos 2025, arXiv:2506.09477): both pull.
    """
    if kind in KL_LOSS_KINDS:
        return kind
    why = (
        "its expected gradient on-policy is E[grad log pi] = 0 (noise, no pull towards the reference)"
        if kind == "k1"
        else "its gradient sign(x) grad log pi is not that of a divergence"
    )
    raise ValueError(
        f"KL estimator '{kind}' as a loss term: {why}. Use k3 (verl's low_var_kl) or k2; k1 is for a KL "
        "penalty in the reward (ppo's use_kl_in_reward), where no gradient flows through it."
    )


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference, (B, T).

    ``k1``: logp - ref; ``abs``: |logp - ref|; ``k2``: 0.5 (logp - ref)^2;
    ``k3``: exp(x) - x - 1 with x = clamp(ref - logp, -20, 20), clamped to [-10, 10].
    """
    if kind == "k1":
        return logp - ref_logp
    if kind == "abs":
        return (logp - ref_logp).abs()
    if kind == "k2":
        return 0.5 * (logp - ref_logp).square()
    if kind == "k3":
        x = torch.clamp(ref_logp - logp, -20.0, 20.0)
        return torch.clamp(torch.exp(x) - x - 1, -10.0, 10.0)
    raise ValueError(f"Unknown KL kind '{kind}'. Available: {', '.join(KL_KINDS)}.")


def policy_loss(
    old_logp: torch.Tensor,
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float = 3.0,
    agg_mode: str | LossAggregation = "token-mean",
    token_weights: torch.Tensor | None = None,  # (B, T) detached, e.g. truncated_is_weights
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with dual clip for negative advantages; all tensors (B, T).

    ratio = exp(clamp(logp - old, -20, 20)); per token
    L = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), and for A < 0 additionally
    L = min(L, -A clip_c) (dual clip, Ye et al. 2020). ``token_weights`` w multiply L before the
    aggregation, whose normaliser they leave as it is: agg(w L). Returns the aggregated loss and
    the metrics ``clipfrac``, ``clipfrac_lower`` and ``ppo_kl`` (mean of old - logp), unweighted.
    """
    mask = mask.to(logp.dtype)
    log_ratio = torch.clamp(logp - old_logp, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -advantages * clip_c
    dual = torch.minimum(loss3, clipped)
    losses = torch.where(advantages < 0, dual, clipped)
    metrics = {
        "clipfrac": masked_mean((loss2 > loss1).to(logp.dtype), mask).detach(),
        "clipfrac_lower": masked_mean(((clipped > loss3) & (advantages < 0)).to(logp.dtype), mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, mask).detach(),
    }
    if token_weights is not None:
        losses = losses * token_weights
    return agg_loss(losses, mask, agg_mode), metrics


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last dimension: (..., V) -> (...)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[tokens]: (..., V), (...) -> (...), computed in float32."""
    logits = logits.float()
    return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def outcome_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token rewards (B, T) holding each response's score (B,) at its last unmasked token, 0 elsewhere.

    This is how verl turns an outcome reward into ``token_level_scores`` (the score sits at
    ``valid_response_length - 1``); a response with an empty mask gets no reward.
    """
    mask = mask.to(scores.dtype if scores.is_floating_point() else torch.float32)
    T = mask.shape[-1]
    positions = torch.arange(T, device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(-1).values  # (B,)
    rewards = torch.zeros_like(mask)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    rewards[rows, last[rows]] = scores[rows].to(rewards.dtype)
    return rewards


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Reward-to-go G_t = r_t + gamma * G_{t+1} over unmasked tokens: (B, T) -> (B, T).

    Masked positions (padding, or observation tokens in the middle of a multi-turn
    response) are skipped: they add no reward and no discount, the running return is carried
    over them unchanged, and their returns are 0. Without holes this equals verl's
    REINFORCE++ returns; verl resets the running return at every masked token, which for a
    hole would cut the credit of the tokens before it.
    """
    mask = mask.to(rewards.dtype)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[-1])):
        m = mask[:, t]
        running = m * (rewards[:, t] + gamma * running) + (1 - m) * running
        returns[:, t] = running * m
    return returns


def group_stats(
    scores: torch.Tensor, group_ids: torch.Tensor, counted: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per response (B,): the mean, unbiased std and size of its group.

    A group of one response has mean 0 and std 1 (verl's convention for GRPO and
    REINFORCE++-baseline: the lone score is kept as it is). ``counted`` (B,) bool: the rows the
    statistics are over (None: all); the others get their group's values (:func:`counted_rows`).
    """
    scores = scores.float()
    mean, std = torch.zeros_like(scores), torch.ones_like(scores)
    count = torch.ones_like(scores)
    counted = None if counted is None else counted.to(device=scores.device, dtype=torch.bool)
    for g in torch.unique(group_ids):
        members = group_ids == g
        in_stats = members if counted is None else members & counted
        n = int(in_stats.sum())
        count[members] = max(n, 1)
        if n > 1:
            mean[members] = scores[in_stats].mean()
            std[members] = scores[in_stats].std()
    return mean, std, count


def counted_rows(batch) -> torch.Tensor | None:
    """The rows a batch's group statistics count (:func:`group_stats`): all but the rows of agent
    episodes' earlier branches (``branch_row``); None when it has none."""
    branch = batch.get("branch_row")
    return None if branch is None else ~branch.bool()


def whiten_advantages(values: torch.Tensor, mask: torch.Tensor, mean_var=None) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) on unmasked positions, 0 elsewhere: (B, T) -> (B, T).

    Mean and unbiased variance are over the mask (as :func:`masked_whiten`), or come from
    ``mean_var(values, mask) -> (mean, var)``, e.g. ``hybridrl.distributed.masked_mean_var``
    to whiten over the batches of every rank. With fewer than two unmasked values there is
    nothing to compare: zeros.
    """
    mask = mask.to(values.dtype)
    if mean_var is None:
        if mask.sum() < 2:
            return torch.zeros_like(values)
        return masked_whiten(values, mask) * mask
    mean, var = mean_var(values, mask)
    return (values - mean) * torch.rsqrt(var + 1e-8) * mask


# --- off-policy correction from the rollout engine's logprobs --------------------------------

ROLLOUT_LEVELS = ("token", "sequence", "geometric")
ROLLOUT_LOG_RATIO_BOUND = 20.0  # exp(20) ~ 4.9e8: log ratios are clamped to +-20 before exponentiating


def rollout_log_ratio(
    old_logp: torch.Tensor,  # (B, T) the trainer's logprobs of the sampled tokens before the update
    rollout_logp: torch.Tensor,  # (B, T) the engine's logprobs of the same tokens
    mask: torch.Tensor,  # (B, T) 1 on sampled tokens; 0 on padding and holes
    level: str = "token",
) -> torch.Tensor:
    """log(pi_old / pi_rollout) at ``level``, in float32, broadcast over the tokens: (B, T).

    With d_t = log pi_old(y_t) - log pi_rollout(y_t) on unmasked tokens:
    ``token``: d_t; ``sequence``: sum_t m d (the log of the response's probability ratio);
    ``geometric``: sum_t m d / sum_t m (the log of the geometric mean of its token ratios).
    0 on masked positions, whatever their logprobs hold (-inf included); not clamped.
    """
    if level not in ROLLOUT_LEVELS:
        raise ValueError(f"Unknown rollout correction level '{level}'. Available: {', '.join(ROLLOUT_LEVELS)}.")
    valid = mask.bool()
    d = torch.where(valid, old_logp.float() - rollout_logp.float(), 0.0)  # (B, T)
    if level == "token":
        return d
    seq = d.sum(-1, keepdim=True)  # (B, 1)
    if level == "geometric":
        seq = seq / valid.sum(-1, keepdim=True).clamp(min=1)
    return torch.where(valid, seq.expand_as(d), 0.0)


@torch.no_grad()
def truncated_is_weights(
    old_logp: torch.Tensor,  # (B, T)
    rollout_logp: torch.Tensor,  # (B, T)
    mask: torch.Tensor,  # (B, T)
    level: str = "token",
    cap: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance sampling weights w = min(exp(l), C) and where w was capped, both (B, T).

    ``l`` is :func:`rollout_log_ratio` at ``level``, clamped to [-20, 20] before the exponential
    (float32). ``token`` is TIS (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training"; verl's ``rollout_is: token``, TRL's ``token_truncate``);
    ``sequence`` one weight per response, min(prod_t ratio_t, C) (verl's ``rollout_is: sequence``,
    TRL's ``sequence_truncate``); ``geometric`` min(exp(mean_t log ratio_t), C). Detached; 0 and
    not truncated on masked positions.
    """
    log_w = rollout_log_ratio(old_logp, rollout_logp, mask, level)
    valid = mask.bool()
    truncated = (log_w > math.log(cap)) & valid
    weights = torch.exp(log_w.clamp(-ROLLOUT_LOG_RATIO_BOUND, ROLLOUT_LOG_RATIO_BOUND)).clamp(max=cap)
    return torch.where(valid, weights, 0.0), truncated


@torch.no_grad()
def rollout_ratio_mask(
    old_logp: torch.Tensor,  # (B, T)
    rollout_logp: torch.Tensor,  # (B, T)
    mask: torch.Tensor,  # (B, T)
    level: str = "token",
    low: float = 0.5,
    high: float = 5.0,
) -> torch.Tensor:
    """1 where the ratio of :func:`rollout_log_ratio` at ``level`` lies in [low, high], else 0: (B, T).

    ``token`` drops single tokens (IcePop, Ling Team 2025, arXiv:2510.18855, with [0.5, 5]; verl's
    ``rollout_rs: token``); ``sequence`` and ``geometric`` drop whole responses by their product or
    geometric-mean ratio (verl's ``rollout_rs: sequence / geometric``). The bounds are compared in
    log space on the unclamped log ratio (exact, no overflow). float32; 0 on masked positions.
    """
    log_w = rollout_log_ratio(old_logp, rollout_logp, mask, level)
    keep = (log_w >= math.log(low)) & (log_w <= math.log(high)) & mask.bool()
    return keep.float()


@torch.no_grad()
def rollout_correction_metrics(
    old_logp: torch.Tensor,  # (B, T)
    rollout_logp: torch.Tensor,  # (B, T)
    mask: torch.Tensor,  # (B, T)
    weights: torch.Tensor,  # (B, T) the weights the token losses are multiplied by
    truncated: torch.Tensor | None = None,  # (B, T) bool, from truncated_is_weights
    keep: torch.Tensor | None = None,  # (B, T), from rollout_ratio_mask
) -> dict[str, torch.Tensor]:
    """The weights and the engine's mismatch, over the unmasked tokens (tensors: read them later).

    ``rollout_corr/weight_mean``, ``weight_max``, ``weight_min``: of ``weights`` (the masked-out
    tokens' zeros included); ``truncated_fraction``: tokens whose weight was capped (with
    ``truncated``); ``masked_fraction``: tokens that ``keep`` dropped (with ``keep``); and the KL of
    the engine's distribution to the trainer's, KL(pi_rollout || pi_old), from tokens the engine
    sampled, with d = log pi_old - log pi_rollout: ``kl_k1`` = mean(-d), ``kl_k3`` =
    mean(exp(d) - d - 1), d clamped to [-20, 20] (J. Schulman's estimators; verl's ``kl`` and
    ``k3_kl`` of ``rollout_corr``). An empty mask gives max 0 and min +inf, which the reductions
    over micro-batches and ranks ignore.
    """
    valid = mask.bool()
    m = valid.float()
    d = rollout_log_ratio(old_logp, rollout_logp, mask).clamp(-ROLLOUT_LOG_RATIO_BOUND, ROLLOUT_LOG_RATIO_BOUND)
    w = weights.float()
    out = {
        "rollout_corr/weight_mean": masked_mean(w, m),
        "rollout_corr/weight_max": w.masked_fill(~valid, 0.0).max(),
        "rollout_corr/weight_min": w.masked_fill(~valid, float("inf")).min(),
        "rollout_corr/kl_k1": masked_mean(-d, m),
        "rollout_corr/kl_k3": masked_mean(torch.exp(d) - d - 1, m),
    }
    if truncated is not None:
        out["rollout_corr/truncated_fraction"] = masked_mean(truncated.float(), m)
    if keep is not None:
        out["rollout_corr/masked_fraction"] = masked_mean(1.0 - keep.float(), m)
    return out
