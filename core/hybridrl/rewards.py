"""The run's rewards as one object: score each response with every reward function, shape, combine
with weights, report statistics over every rank, checkpoint the shaping state, close.

The reward functions themselves are plugins (``rewards: [{function: ...}]``); the built-in ones
live in :mod:`hybridrl.builtin.rewards`.
"""

from __future__ import annotations

import sys

import torch

from hybridrl import distributed
from hybridrl.batch import Batch
from hybridrl.devices import device_errors
from hybridrl.errors import StageError, stage_errors
from hybridrl.shaping import ShapingState


class Rewards:
    """``(RewardConfig, RewardFunction)`` pairs in config order, and the shaping statistics."""

    def __init__(self, pairs: list, policy_device: torch.device):
        self.pairs = pairs
        self.policy_device = policy_device
        self.shaping = ShapingState()  # the rewards' running statistics, checkpointed

    @property
    def labels(self) -> list[str]:
        return [rc.label for rc, _ in self.pairs]

    def stateful(self) -> dict:
        """What goes into checkpoints: the shaping statistics and each function that has state."""
        return {"shaping": self.shaping, **{f"reward/{rc.label}": fn for rc, fn in self.pairs}}

    def score(self, batch: Batch) -> dict[str, float]:
        """Set ``batch["reward/<label>"]`` (each reward, before shaping) and ``batch["scores"]`` (the
        weighted sum of the shaped rewards), (B,); returns their statistics over every rank."""
        total = torch.zeros(len(batch))
        metrics = {}
        lengths = batch["response_mask"].sum(-1).float()
        for i, (rc, fn) in enumerate(self.pairs):
            component = f"reward '{rc.label}' (function '{rc.function}')"
            with stage_errors(component, "score"), self.device_errors(component, i, fn):
                s = torch.as_tensor(fn.score(batch), dtype=torch.float32).reshape(-1)
            if s.shape[0] != len(batch):
                raise StageError(
                    f"{component} failed in score: it returned {s.shape[0]} scores for the batch's {len(batch)} "
                    "responses. score(batch) returns one number per row of the batch (len(batch))."
                )
            if not torch.isfinite(s).all():  # the step then aborts or skips, naming this reward first
                bad = int((~torch.isfinite(s)).sum())
                print(f"warning: reward '{rc.label}' returned NaN/Inf for {bad} responses", file=sys.stderr)
            batch[f"reward/{rc.label}"] = s
            metrics |= {f"reward/{rc.label}/{k}": float(v) for k, v in fn.metrics().items()}
            every = distributed.all_gather_cat(s) if rc.shaping.active else None  # the same on every rank
            if every is not None and torch.isfinite(every).all():  # NaN/Inf: left to the step's guard
                shaped = self.shaping.apply(rc.label, every, distributed.all_gather_cat(lengths), rc.shaping)
                sizes = distributed.all_gather_cat(torch.tensor([len(s)]))
                start = int(sizes[: distributed.rank()].sum())
                s = shaped[start : start + len(s)]  # this rank's rows, shaped with the whole step's statistics
                metrics[f"reward/{rc.label}/shaped_mean"] = shaped.mean().item()
            total += rc.weight * s
        batch["scores"] = total
        return metrics | self.stats(batch)

    def stats(self, batch: Batch) -> dict[str, float]:
        """Mean, std, min and max of each reward (before shaping) and of the combined score, over
        the responses of every rank."""
        metrics = {}
        for key in [f"reward/{label}" for label in self.labels] + ["scores"]:
            every = distributed.all_gather_cat(batch[key])  # the statistics of the whole step, on every rank
            name = "reward" if key == "scores" else key
            metrics |= {
                f"{name}/mean": every.mean().item(),
                f"{name}/std": every.std().item() if len(every) > 1 else 0.0,
                f"{name}/min": every.min().item(),
                f"{name}/max": every.max().item(),
            }
        return metrics

    def device_errors(self, component: str, index: int, fn):
        """Device errors in a reward's score() name the reward, its device option and the policy's."""
        device = getattr(getattr(fn, "options", None), "device", None)
        placement = {"the reward's device option": device, "the policy (trainer.device)": self.policy_device}
        if device is not None:
            fix = f"Set rewards[{index}].device (now '{device}') to where its model should run."
        else:
            fix = (
                f"Reward function '{type(fn).__name__}' has no device option: check where it puts its model and inputs."
            )
        return device_errors(component, placement, fix)

    def close(self) -> None:
        """Release every reward function (models, HTTP sessions), the first failure raised last."""
        errors = []
        for _, fn in self.pairs:
            try:
                fn.close()
            except Exception as e:  # noqa: BLE001 - close the others first
                errors.append(e)
        if errors:
            raise errors[0]
