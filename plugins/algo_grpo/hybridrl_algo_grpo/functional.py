"""Group-relative advantage estimators (conventions of verl's core_algos.py)."""

from __future__ import annotations

import torch


def group_advantages(
    scores: torch.Tensor,  # (B,) one scalar reward per response
    mask: torch.Tensor,  # (B, T) response mask
    group_ids: torch.Tensor,  # (B,) responses with the same id answer the same prompt
    norm_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantage (s - mean_g) / (std_g + eps), broadcast over the response tokens: (B, T).

    Mean and unbiased std are per group; a group of one response has mean 0 and std 1.
    ``norm_std=False`` gives Dr. GRPO's s - mean_g.
    """
    scores = scores.float()
    mean = torch.zeros_like(scores)
    std = torch.ones_like(scores)
    for g in torch.unique(group_ids):
        members = group_ids == g
        if members.sum() > 1:
            mean[members] = scores[members].mean()
            std[members] = scores[members].std()
    adv = (scores - mean) / (std + eps) if norm_std else scores - mean
    return adv.unsqueeze(-1) * mask.to(adv.dtype)
