"""PPO math: GAE, the clipped value loss, KL in the reward and its adaptive coefficient.

Conventions follow volcengine/verl's ``trainer/ppo/core_algos.py``
(``compute_gae_advantage_return``, ``compute_value_loss``, ``AdaptiveKLController``) and
``ray_trainer.apply_kl_penalty``, so numbers are comparable. Shapes: B responses, T response
tokens; ``mask`` is the (B, T) response mask (1 on tokens the policy generated).
"""

from __future__ import annotations

import torch

from hybridrl import functional as F


@torch.no_grad()
def gae(
    rewards: torch.Tensor,  # (B, T) token rewards
    values: torch.Tensor,  # (B, T) V(s_t): the critic's value before response token t
    mask: torch.Tensor,  # (B, T)
    gamma: float = 1.0,
    lam: float = 1.0,
    mean_var=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2015, arXiv:1506.02438).

    Backwards over t: delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma lam A_next,
    where V_next and A_next come from the next *unmasked* position: at a masked position
    (padding, or an observation token inside a multi-turn response) both are carried over
    unchanged, as verl does. returns = A + V (before whitening); the advantages are then
    whitened over the mask (unbiased variance; over every rank's batch with ``mean_var``, see
    :func:`hybridrl.functional.whiten_advantages`) and zeroed on masked positions.
    Returns ``(advantages, returns)``, both (B, T).
    """
    mask = mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[-1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        next_value = m * values[:, t] + (1 - m) * next_value
        next_adv = m * adv_t + (1 - m) * next_adv
        advantages[:, t] = next_adv
    returns = advantages + values
    return F.whiten_advantages(advantages, mask, mean_var), returns


def value_loss(
    vpreds: torch.Tensor,  # (B, T) values of the critic being trained, with grad
    returns: torch.Tensor,  # (B, T) GAE returns (targets)
    old_values: torch.Tensor,  # (B, T) the critic's values when the batch was scored
    mask: torch.Tensor,  # (B, T)
    cliprange_value: float = 0.5,
    agg_mode: str | F.LossAggregation = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss 0.5 agg(max((v - R)^2, (clip(v, V_old - c, V_old + c) - R)^2)).

    Returns the loss and the fraction of tokens where the clipped term is the larger
    (``vf_clipfrac``).
    """
    clipped = torch.clamp(vpreds, old_values - cliprange_value, old_values + cliprange_value)
    loss1 = (vpreds - returns) ** 2
    loss2 = (clipped - returns) ** 2
    loss = 0.5 * F.agg_loss(torch.maximum(loss1, loss2), mask, agg_mode)
    clipfrac = F.masked_mean((loss2 > loss1).to(vpreds.dtype), mask.to(vpreds.dtype)).detach()
    return loss, clipfrac


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, mean_var=None) -> float:
    """1 - Var(R - V) / (Var(R) + 1e-5) over unmasked tokens (unbiased variances), as verl logs it.

    1 is a perfect critic, 0 one that predicts a constant; fewer than two tokens give 0.
    ``mean_var(x, mask) -> (mean, var)`` takes the variances over a wider set (every rank).
    """
    if mean_var is not None:
        _, diff_var = mean_var((returns - values).float(), mask)
        _, return_var = mean_var(returns.float(), mask)
        return float(1.0 - diff_var / (return_var + 1e-5))
    keep = mask.bool()
    if keep.sum() < 2:
        return 0.0
    v, r = values[keep].float(), returns[keep].float()
    return (1.0 - torch.var(r - v) / (torch.var(r) + 1e-5)).item()


def kl_penalized_rewards(
    scores: torch.Tensor,  # (B,) outcome rewards
    old_logp: torch.Tensor,  # (B, T) logprobs of the policy that sampled
    ref_logp: torch.Tensor,  # (B, T) logprobs of the reference policy
    mask: torch.Tensor,  # (B, T)
    beta: float,
    kind: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rewards r_t = [t is the last token] score - beta kl_t, with kl_t = kl_penalty(old, ref).

    Returns the rewards (B, T) and each response's mean token KL (B,): their mean over the
    responses is the KL the adaptive controller sees (verl's ``apply_kl_penalty``).
    """
    mask = mask.to(old_logp.dtype)
    kl = F.kl_penalty(old_logp, ref_logp, kind) * mask
    rewards = F.outcome_token_rewards(scores.to(old_logp.dtype), mask) - beta * kl
    return rewards, F.masked_mean(kl, mask, -1)


def adaptive_kl_coef(coef: float, current_kl: float, target: float, horizon: float, n_steps: int) -> float:
    """The adaptive KL controller of Ziegler et al. 2019 (arXiv:1909.08593).

    beta <- beta (1 + clip(KL / target - 1, -0.2, 0.2) n_steps / horizon); verl passes the
    number of responses of the step as ``n_steps``.
    """
    error = min(max(current_kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * n_steps / horizon)
