"""The step's metrics: what each stage measures, and how values of micro-batches and ranks combine.

One rule for every metric: names ending in ``max`` or ``min`` (``response_length/max``,
``rollout/logprob_diff_max``) are the max or min over micro-batches and ranks; ``timing/*`` the
slowest rank's; ``throughput/*`` the sum over ranks; everything else a mean. Statistics of tokens
(the actor's entropy, its loss terms, the engine's logprob mismatch) are weighted by the tokens
they were taken over, so micro-batches made only of padding rows count for nothing.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections import defaultdict

import torch

from hybridrl import distributed
from hybridrl import functional as F
from hybridrl.batch import Batch
from hybridrl.flops import forward_flops, peak_flops

_EXTREME = re.compile(r"(?:^|[/_])(max|min)$")


def extreme(name: str) -> str | None:
    """``"max"`` or ``"min"`` for metrics whose name ends so, else None."""
    m = _EXTREME.search(name)
    return m.group(1) if m else None


class WeightedStats:
    """Per-pass values (micro-batches, mini-batches) combined over passes and ranks: weighted means,
    and max/min for the names that end so (:func:`extreme`). Values may be tensors, read only in
    :meth:`result` (after the backward passes, so that reading them does not stall the device)."""

    def __init__(self):
        self.values: dict[str, list[tuple[object, float]]] = defaultdict(list)

    def add(self, metrics: dict, weight: float = 1.0) -> None:
        for key, value in metrics.items():
            self.values[key].append((value, float(weight)))

    def result(self) -> dict[str, float]:
        """One value per metric over every pass of every rank (a collective under torchrun)."""
        local: dict[str, tuple[float, float]] = {}  # key -> (weighted sum or extreme, weight)
        for key, entries in self.values.items():
            values = [(float(v), w) for v, w in entries]
            kind = extreme(key)
            if kind:
                local[key] = ((max if kind == "max" else min)(v for v, _ in values), 1.0)
            else:
                local[key] = (sum(v * w for v, w in values), sum(w for _, w in values))
        merged: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for part in distributed.all_gather_objects(local):
            for key, entry in part.items():
                merged[key].append(entry)
        out = {}
        for key, entries in merged.items():
            kind = extreme(key)
            if kind:
                out[key] = (max if kind == "max" else min)(v for v, _ in entries)
            else:
                weight = sum(w for _, w in entries)
                out[key] = sum(v for v, _ in entries) / weight if weight > 0 else 0.0
        return out


class Timer:
    """Seconds per stage (``timing/<stage>``); on a GPU each stage ends by waiting for its kernels."""

    def __init__(self, device: torch.device | None = None, on_enter=None):
        self.times: dict[str, float] = {}
        self.cuda = device is not None and device.type == "cuda"
        self.on_enter = on_enter  # called with the stage's name as it starts (heartbeats)

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.on_enter is not None:
            self.on_enter(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing/{k}": v for k, v in self.times.items()} | {"timing/step": sum(self.times.values())}


def reduce_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """One value per metric for the whole step over all ranks: max/min for names that end so,
    ``timing/*`` the max (the slowest rank sets the pace), ``throughput/*`` the sum, else the mean.
    Metrics that only some ranks have are reduced over those."""
    if distributed.world_size() == 1:
        return metrics
    merged: dict[str, list[float]] = defaultdict(list)
    for part in distributed.all_gather_objects({k: float(v) for k, v in metrics.items()}):
        for k, v in part.items():
            merged[k].append(v)
    out = {}
    for k, vs in merged.items():
        kind = extreme(k)
        if kind == "max" or k.startswith("timing/"):
            out[k] = max(vs)
        elif kind == "min":
            out[k] = min(vs)
        elif k.startswith("throughput/"):
            out[k] = sum(vs)
        else:
            out[k] = sum(vs) / len(vs)
    return out


def mismatch_metrics(rollout_lp: torch.Tensor, train_lp: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """How far the engine's logprobs are from the trainer's for the same weights and tokens, all
    (B, T): the mean and the max of |difference| over the mask (tensors: read them later)."""
    diff = (rollout_lp.to(train_lp.device) - train_lp).abs() * mask
    return {
        "rollout/logprob_diff_mean": F.masked_mean(diff, mask).detach(),
        "rollout/logprob_diff_max": diff.max().detach(),
    }


def update_throughput(
    policy, batch: Batch, epochs: int, seconds: float, device: torch.device, share_prompts: bool = False
) -> dict[str, float]:
    """Tokens/s and model FLOP/s through the policy's forward+backward passes of the update
    stage (all epochs; padding not counted), and the MFU where the GPU's peak is known. Tokens
    count every row's prompt. With ``share_prompts`` FLOPs count a prompt once for all the rows
    that share it: a lower bound of the work done, since a prompt whose rows went to several
    passes ran once in each."""
    lengths = (batch["prompt_mask"].sum(-1) + batch.response_lengths()).tolist()
    responses = int(batch.response_lengths().sum())
    seconds = max(seconds, 1e-9)
    shared = []
    if share_prompts:
        prompts, mask = batch["prompts"], batch["prompt_mask"]
        unique, counts = torch.unique(torch.cat([prompts * mask, mask], 1), dim=0, return_counts=True)
        shared = list(zip(unique[:, prompts.shape[1] :].sum(-1).tolist(), counts.tolist()))
    flops = 3 * epochs * forward_flops(policy, lengths, responses, shared) / seconds
    out = {"throughput/train_tokens_per_s": sum(lengths) * epochs / seconds, "throughput/update_tflops": flops / 1e12}
    peak = peak_flops(device)
    if peak:
        out["throughput/update_mfu"] = flops / peak
    return out


def batch_metrics(batch: Batch, rollout_time: float, rollout: Batch | None = None) -> dict[str, float]:
    """Length and throughput metrics of all rollouts; advantage statistics of the trained batch."""
    rollout = rollout if rollout is not None else batch
    lengths = rollout["response_mask"].sum(-1).float()
    clipped = sum(r == "length" for r in rollout["finish_reason"]) / len(rollout)
    adv = batch.get("advantages")
    out = {
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "response_length/min": lengths.min().item(),
        "response_length/clip_ratio": clipped,
        "prompt_length/mean": rollout["prompt_mask"].sum(-1).float().mean().item(),
        "throughput/rollout_tokens_per_s": lengths.sum().item() / max(rollout_time, 1e-9),
    }
    if "turns" in rollout:  # multi-turn trajectories
        out["agent/turns_mean"] = sum(rollout["turns"]) / len(rollout)
        infos = rollout["agent_info"]
        for key in sorted({"tool_calls", "tool_errors", "observation_tokens"}.union(*infos)):
            out[f"agent/{key}_mean"] = sum(float(info.get(key, 0)) for info in infos) / len(infos)
        out["agent/trajectory_length_mean"] = rollout.response_lengths().float().mean().item()
    if adv is not None:
        mask = batch["response_mask"]
        out["advantages/mean"] = F.masked_mean(adv, mask).item()
        out["advantages/max"] = adv[mask.bool()].max().item() if mask.any() else 0.0
        out["advantages/min"] = adv[mask.bool()].min().item() if mask.any() else 0.0
    return out


def sample_rows(batch: Batch, labels: list[str]) -> list[dict]:
    """The rollout samples to log: prompt, response, answer, score, each reward (``labels``), advantage."""
    rows = []
    adv = batch.get("advantages")
    for i in range(len(batch)):
        row = {
            "prompt": batch["prompt_text"][i],
            "response": batch["response_text"][i],
            "answer": batch["answer"][i],
            "score": batch["scores"][i].item(),
            "finish_reason": batch["finish_reason"][i],
            "group": int(batch["group_ids"][i]),
        }
        row |= {f"reward/{label}": batch[f"reward/{label}"][i].item() for label in labels}
        if adv is not None:
            row["advantage"] = adv[i, 0].item()
        rows.append(row)
    return rows
