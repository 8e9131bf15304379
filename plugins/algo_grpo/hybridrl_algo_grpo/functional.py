"""Critic-free advantage estimators and GRPO-family loss pieces.

Conventions follow volcengine/verl's ``trainer/ppo/core_algos.py`` (the estimators
``compute_grpo_outcome_advantage``, ``compute_rloo_outcome_advantage``,
``compute_reinforce_plus_plus_outcome_advantage``,
``compute_reinforce_plus_plus_baseline_outcome_advantage`` and the policy loss ``gspo``) and
its DAPO recipe, so numbers are comparable. Shapes: B responses, T response tokens; ``mask``
is the (B, T) response mask, ``group_ids`` (B,) names the prompt each response answers.
"""

from __future__ import annotations

import torch

from hybridrl import functional as F


def group_advantages(
    scores: torch.Tensor,  # (B,) one scalar reward per response
    mask: torch.Tensor,  # (B, T) response mask
    group_ids: torch.Tensor,  # (B,) responses with the same id answer the same prompt
    norm_std: bool = True,
    eps: float = 1e-6,
    counted: torch.Tensor | None = None,  # (B,) bool: the rows the group statistics count (None: all)
) -> torch.Tensor:
    """GRPO advantage (s - mean_g) / (std_g + eps), broadcast over the response tokens: (B, T).

    Mean and unbiased std are per group; a group of one response has mean 0 and std 1.
    ``norm_std=False`` gives Dr. GRPO's s - mean_g (Liu et al. 2025, arXiv:2503.20783).
    ``counted``: see :func:`hybridrl.functional.group_stats` (an agent episode's earlier branches).
    """
    scores = scores.float()
    mean, std, _ = F.group_stats(scores, group_ids, counted)
    adv = (scores - mean) / (std + eps) if norm_std else scores - mean
    return adv.unsqueeze(-1) * mask.to(adv.dtype)


def rloo_advantages(
    scores: torch.Tensor,  # (B,)
    mask: torch.Tensor,  # (B, T)
    group_ids: torch.Tensor,  # (B,)
    counted: torch.Tensor | None = None,  # (B,) bool: the rows the group statistics count (None: all)
) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740): s_i - mean of the other scores of the group.

    Computed as n/(n-1) * (s_i - mean_g). A group of one response has no others: its
    advantage is its score (no baseline), as in verl. Broadcast over tokens: (B, T).
    """
    scores = scores.float()
    mean, _, n = F.group_stats(scores, group_ids, counted)
    adv = torch.where(n > 1, (scores - mean) * n / (n - 1).clamp(min=1), scores)
    return adv.unsqueeze(-1) * mask.to(adv.dtype)


def reinforce_pp_advantages(
    scores: torch.Tensor,  # (B,)
    mask: torch.Tensor,  # (B, T)
    gamma: float = 1.0,
    mean_var=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): token returns whitened over the whole batch.

    The score is the reward of the last response token; returns G_t = r_t + gamma G_{t+1}
    skip masked positions (:func:`hybridrl.functional.discounted_returns`); advantages are
    (G - mean) / sqrt(var + 1e-8) over all unmasked tokens of the batch (over every rank's
    batch with ``mean_var``, see :func:`hybridrl.functional.whiten_advantages`). Returns
    ``(advantages, returns)``, both (B, T).
    """
    mask = mask.float()
    returns = F.discounted_returns(F.outcome_token_rewards(scores.float(), mask), mask, gamma)
    return F.whiten_advantages(returns, mask, mean_var), returns


def reinforce_pp_baseline_advantages(
    scores: torch.Tensor,  # (B,)
    mask: torch.Tensor,  # (B, T)
    group_ids: torch.Tensor,  # (B,)
    mean_var=None,
    counted: torch.Tensor | None = None,  # (B,) bool: the rows the group statistics count (None: all)
) -> torch.Tensor:
    """REINFORCE++-baseline: s - mean_g broadcast over the tokens, then whitened over the batch.

    A group of one response has mean 0 (its score is kept), as in verl. (B, T).
    """
    mask = mask.float()
    scores = scores.float()
    mean, _, _ = F.group_stats(scores, group_ids, counted)
    centred = (scores - mean).unsqueeze(-1) * mask
    return F.whiten_advantages(centred, mask, mean_var)


def varied_groups(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling (Yu et al. 2025, arXiv:2503.14476): which responses to keep, (B,) bool.

    A group is kept when its scores are not all equal, or when it has one response (verl's
    DAPO recipe keeps ``std > 0 or len == 1``). Groups whose responses all scored the same
    have zero group-relative advantage and only add noise through the KL term.
    """
    keep = torch.zeros(scores.shape[0], dtype=torch.bool)
    for g in torch.unique(group_ids):
        members = group_ids == g
        s = scores[members]
        keep[members.cpu()] = bool(s.numel() == 1 or (s != s[0]).any())
    return keep.to(scores.device)


def overlong_penalty(
    lengths: torch.Tensor,  # (B,) response lengths in tokens
    max_length: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the score: (B,).

    With L_exp = max_length - buffer_length: 0 for lengths up to L_exp, then
    -(length - L_exp) / buffer_length * penalty_factor, reaching -penalty_factor at
    max_length (verl's DAPO reward manager: ``min(-exceed_len / buffer_len * factor, 0)``).
    """
    expected = max_length - buffer_length
    exceed = lengths.float() - expected
    return torch.clamp(-exceed / buffer_length * penalty_factor, max=0.0)


def gspo_policy_loss(
    old_logp: torch.Tensor,  # (B, T) logprobs under the sampling policy
    logp: torch.Tensor,  # (B, T) logprobs under the current policy, with grad
    advantages: torch.Tensor,  # (B, T) one value per response, broadcast over its tokens
    mask: torch.Tensor,  # (B, T)
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    agg_mode: str | F.LossAggregation = "seq-mean-token-mean",
    token_weights: torch.Tensor | None = None,  # (B, T) detached, e.g. hybridrl.functional.truncated_is_weights
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071): a sequence-level importance ratio, clipped.

    s_i = exp(mean_t (logp - old)) over the unmasked tokens of response i (the geometric mean
    of token ratios). In its token form (GSPO-token, eq. 13-14 of the paper)
    s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)] has the value s_i and the gradient of s_i. Per token
    L = max(-A s_i,t, -A clip(s_i,t, 1 - clip_low, 1 + clip_high)); the log ratio is clamped at
    10 as in verl. With ``seq-mean-token-mean`` aggregation this is the paper's objective. No
    dual clip. ``token_weights`` w multiply L before the aggregation: agg(w L) (one weight per
    response, from a sequence-level correction, matches the sequence-level ratio; token weights
    reweigh each token's term of it). Metrics: ``clipfrac`` (tokens whose sequence is clipped) and
    ``ppo_kl``, unweighted.
    """
    mask = mask.to(logp.dtype)
    log_ratio = logp - old_logp
    seq_log_ratio = F.masked_sum(log_ratio, mask, -1) / mask.sum(-1).clamp(min=1)  # (B,)
    log_s = logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)
    s = torch.exp(torch.clamp(log_s, max=10.0))
    loss1 = -advantages * s
    loss2 = -advantages * torch.clamp(s, 1 - clip_low, 1 + clip_high)
    losses = torch.maximum(loss1, loss2)
    metrics = {
        "clipfrac": F.masked_mean((loss2 > loss1).to(logp.dtype), mask).detach(),
        "ppo_kl": F.masked_mean(-log_ratio, mask).detach(),
    }
    if token_weights is not None:
        losses = losses * token_weights
    return F.agg_loss(losses, mask, agg_mode), metrics
