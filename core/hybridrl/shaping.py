"""Score shaping shared by every reward: normalisation, length penalty, clipping.

Each reward's raw (B,) scores go through :func:`shape_scores` before the rewards are combined
with their weights. The order is fixed and documented:

1. **normalise** the raw scores: ``(s - mean) / sqrt(var + eps)`` with the mean and
   (unbiased) variance of this batch (``batch``) or of every score seen so far
   (``running``; exact by Welford/Chan merging, or an exponential moving average when
   ``momentum`` is set);
2. **length penalty**: subtract ``length_penalty * max(0, length - length_free_tokens)``,
   lengths in response tokens;
3. **clip** to ``[low, high]``.

The running statistics are a small :class:`RunningStats` value that the caller keeps (and
checkpoints with ``state_dict``); :func:`shape_scores` never mutates its inputs and returns
the updated statistics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator


class ShapingOptions(BaseModel):
    """How one reward's scores are shaped; the default changes nothing."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    normalize: Literal["none", "batch", "running"] = Field(
        "none",
        description="Whiten the raw scores: 'batch' with this batch's mean and std, 'running' with the mean "
        "and std of every score seen so far (see momentum); 'none' leaves them.",
    )
    center: bool = Field(True, description="Subtract the mean when normalising; False divides by the std only.")
    momentum: float | None = Field(
        None,
        gt=0,
        le=1,
        description="For normalize=running: unset = exact mean and variance over all scores seen (Welford); "
        "a value m = exponential moving average, new = (1 - m) * old + m * batch.",
    )
    eps: float = Field(1e-8, gt=0, description="Added to the variance before the square root.")
    length_penalty: float = Field(
        0.0,
        ge=0,
        description="Subtract this much per response token beyond length_free_tokens (after normalising). "
        "DAPO's soft overlong penalty: length_free_tokens = max_tokens - L, length_penalty = 1 / L.",
    )
    length_free_tokens: int = Field(0, ge=0, description="Response tokens that carry no length penalty.")
    clip: tuple[float, float] | None = Field(
        None, description="[low, high]: clamp the shaped score to this range (the last step)."
    )

    @model_validator(mode="after")
    def _check(self):
        if self.clip is not None and not self.clip[0] < self.clip[1]:
            raise ValueError(f"shaping.clip must be [low, high] with low < high, got {list(self.clip)}.")
        if self.momentum is not None and self.normalize != "running":
            raise ValueError(
                f"shaping.momentum is set but shaping.normalize is '{self.normalize}': momentum applies to "
                "normalize=running only. Remove momentum or set normalize: running."
            )
        return self

    @property
    def active(self) -> bool:
        """Whether shaping changes anything."""
        return self.normalize != "none" or self.length_penalty > 0 or self.clip is not None


@dataclass(frozen=True)
class RunningStats:
    """Running mean and unbiased variance of the raw scores of one reward."""

    count: int = 0
    mean: float = 0.0
    var: float = 0.0

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "var": self.var}

    @classmethod
    def from_state_dict(cls, state: dict) -> RunningStats:
        return cls(int(state["count"]), float(state["mean"]), float(state["var"]))


def batch_stats(scores: torch.Tensor) -> tuple[float, float]:
    """Mean and unbiased variance of a (B,) tensor; the variance of one value is 0."""
    x = scores.double()
    n = x.numel()
    mean = x.mean().item()
    var = ((x - mean) ** 2).sum().item() / (n - 1) if n > 1 else 0.0
    return mean, var


def update_stats(stats: RunningStats, scores: torch.Tensor, momentum: float | None = None) -> RunningStats:
    """``stats`` merged with the (B,) ``scores``: exactly (Chan et al.) or as a moving average."""
    n = scores.numel()
    if n == 0:
        return stats
    mean_b, var_b = batch_stats(scores)
    if stats.count == 0:
        return RunningStats(n, mean_b, var_b)
    if momentum is not None:
        return RunningStats(
            stats.count + n,
            (1 - momentum) * stats.mean + momentum * mean_b,
            (1 - momentum) * stats.var + momentum * var_b,
        )
    total = stats.count + n
    delta = mean_b - stats.mean
    m2 = stats.var * (stats.count - 1) + var_b * (n - 1) + delta * delta * stats.count * n / total
    return RunningStats(total, stats.mean + delta * n / total, m2 / (total - 1))


def shape_scores(
    scores: torch.Tensor,
    lengths: torch.Tensor | None,
    options: ShapingOptions,
    stats: RunningStats | None = None,
) -> tuple[torch.Tensor, RunningStats | None]:
    """Shape one reward's raw scores.

    :param scores: (B,) raw scores of one reward.
    :param lengths: (B,) response lengths in tokens; needed only with a length penalty.
    :param options: the reward's :class:`ShapingOptions`.
    :param stats: running statistics so far (normalize=running); None = none yet.
    :returns: the (B,) shaped scores (float32, on the device of ``scores``) and the updated
        running statistics (``stats`` unchanged unless normalize=running).
    """
    scores = torch.as_tensor(scores, dtype=torch.float32).reshape(-1)
    if not torch.isfinite(scores).all():
        bad = [i for i, ok in enumerate(torch.isfinite(scores).tolist()) if not ok]
        raise ValueError(f"scores at rows {bad[:8]} are not finite ({scores[bad[0]].item()}); fix the reward.")
    out = scores.double()
    if options.normalize != "none":
        if options.normalize == "running":
            stats = update_stats(stats or RunningStats(), scores, options.momentum)
            mean, var = stats.mean, stats.var
        else:
            mean, var = batch_stats(scores)
        out = ((out - mean) if options.center else out) / math.sqrt(var + options.eps)
    if options.length_penalty > 0:
        if lengths is None:
            raise ValueError("shaping.length_penalty is set, but no response lengths were given.")
        over = (torch.as_tensor(lengths, device=out.device).double().reshape(-1) - options.length_free_tokens).clamp(
            min=0
        )
        out = out - options.length_penalty * over
    if options.clip is not None:
        out = out.clamp(options.clip[0], options.clip[1])
    return out.float(), stats


class ShapingState:
    """The running statistics of every reward of a run, by reward name.

    The trainer holds one and checkpoints it (``state_dict`` is plain numbers, loadable with
    ``torch.load(weights_only=True)``).
    """

    def __init__(self):
        self.stats: dict[str, RunningStats] = {}

    def apply(
        self, name: str, scores: torch.Tensor, lengths: torch.Tensor | None, options: ShapingOptions
    ) -> torch.Tensor:
        """:func:`shape_scores` for reward ``name``, keeping its running statistics."""
        shaped, stats = shape_scores(scores, lengths, options, self.stats.get(name))
        if stats is not None:
            self.stats[name] = stats
        return shaped

    def state_dict(self) -> dict:
        return {name: s.state_dict() for name, s in self.stats.items()}

    def load_state_dict(self, state: dict) -> None:
        self.stats = {name: RunningStats.from_state_dict(s) for name, s in state.items()}
