"""The update stage: one loop trains every model of a run.

The policy and every model an algorithm brings (PPO's critic, :meth:`Algorithm.trained_models`)
are a :class:`Trainable`: a model, its optimizer, a loss of a micro-batch and how that loss
aggregates tokens. :func:`run_update` trains one for ``epochs`` passes over the step's batch, in
mini-batches (one optimizer step each) cut into micro-batches (one forward and backward pass
each; a number of responses, or a token budget), and weighs each micro-batch so that the summed
gradient, averaged over ranks by the sharding strategy, is exactly the gradient of the loss over
the whole mini-batch of every rank. It clips gradients and applies one rule to NaN/Inf losses and
gradient norms: ``on_nonfinite`` (abort, or skip that optimizer step).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from hybridrl import distributed
from hybridrl.batch import Batch, real_rows
from hybridrl.components import Trainable
from hybridrl.memory import memory_errors, pass_fix, pass_sizes
from hybridrl.metrics import WeightedStats
from hybridrl.passes import Runner


def raise_nonfinite(what: str) -> None:
    raise FloatingPointError(what)


def mini_batch_rows(mini_batch_size: int | None, batch_size: int) -> int:
    """Responses per optimizer step on this rank (``mini_batch_size`` is over all ranks)."""
    return mini_batch_size // distributed.world_size() if mini_batch_size else batch_size


def accumulate(t: Trainable, mb: Batch, runner: Runner, stats: WeightedStats, on_nonfinite) -> bool:
    """The gradients of one mini-batch ``mb``, pass by pass (their metrics into ``stats``); False where
    a pass's loss was NaN/Inf on some rank (every rank then stops, ``on_nonfinite`` said so)."""
    world = distributed.world_size()
    # the global normaliser: what the mini-batch of every rank divides its loss by
    total = distributed.sum_over_ranks(t.aggregation.normaliser(mb["response_mask"], real_rows(mb)))
    size = t.micro_batch_size or runner.planner.size  # for out-of-memory messages
    for part in runner.parts(t.model, mb, size=t.micro_batch_size):
        device = part["responses"].device
        with memory_errors(f"the update of the {t.label}", device, pass_sizes(part), pass_fix(part, size)):
            loss, metrics = t.loss(part)
            # ranks average gradients: world x this part's normaliser / the global one
            weight = world * t.aggregation.normaliser(part["response_mask"]) / total if total > 0 else 0.0
            (loss * weight).backward()  # a non-finite loss's gradients are dropped by the caller
        # host syncs wait for queued device work: these after the backward pass, so that the
        # forward and backward passes run without a pause between them
        if distributed.any_rank(not torch.isfinite(loss)):  # all ranks skip, or none
            value = loss.item() if not torch.isfinite(loss) else "NaN/Inf on another rank"
            on_nonfinite(f"the loss of the {t.label} is {value}")
            return False
        stats.add(metrics, weight=float(part["response_mask"].sum()))
    return True


def run_update(
    t: Trainable,
    batch: Batch,
    step: int,
    strategy,
    *,
    seed: int = 0,
    passes: Runner | None = None,
    on_nonfinite: Callable[[str], None] = raise_nonfinite,
) -> dict[str, float]:
    """Train ``t`` on ``batch``; every rank calls it with the same number of rows (collectives run in
    each pass). The trainer's pass runner ``passes`` plans each mini-batch's passes (``t``'s
    micro-batch size, else the trainer's micro-batches); ``t.loss`` gets each pass's rows as a
    :class:`hybridrl.passes.PassBatch` and runs the model's pass with the runner. Without a
    runner, a mini-batch is one padded pass (or ``t``'s micro-batches). ``on_nonfinite(message)``
    raises to stop the run, or returns to skip that optimizer step. Returns the metrics: the loss's, token-weighted
    over passes and ranks, and ``<name>/grad_norm``, ``<name>/lr`` and (when steps were skipped)
    ``<name>/skipped_updates``."""
    runner = passes if passes is not None else Runner(strategy=strategy)
    mini = mini_batch_rows(t.mini_batch_size, len(batch))
    gen = torch.Generator().manual_seed(seed * 7919 + step)
    stats, norms, skipped = WeightedStats(), [], 0
    t.model.train()
    for _ in range(t.epochs):
        # one mini-batch: the order does not change its gradient, so only several are shuffled
        order = torch.randperm(len(batch), generator=gen) if mini < len(batch) else torch.arange(len(batch))
        for mb in batch.select(order).split(mini):
            t.optimizer.zero_grad(set_to_none=True)
            finite = accumulate(t, mb, runner, stats, on_nonfinite)
            if finite:
                grad_norm = strategy.clip_grad_norm(t.model, t.max_grad_norm)  # over all ranks
                norms.append(grad_norm)  # the same on every rank
                if not math.isfinite(grad_norm):
                    on_nonfinite(f"the gradient norm of the {t.label} is {grad_norm}")
                    finite = False
            if finite:
                t.optimizer.step()
            else:
                t.optimizer.zero_grad(set_to_none=True)
                skipped += 1
    out = stats.result() | {f"{t.name}/lr": t.optimizer.param_groups[0]["lr"]}
    if norms:
        out[f"{t.name}/grad_norm"] = sum(norms) / len(norms)
    if skipped:
        out[f"{t.name}/skipped_updates"] = float(skipped)
    if t.scheduler is not None:
        t.scheduler.step()
    return out
