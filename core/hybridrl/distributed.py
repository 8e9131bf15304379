"""torch.distributed for hybridrl: the process group that torchrun describes, and the few
collectives the SPMD loop needs.

``torchrun --nproc-per-node N`` (or its multi-node rendezvous) starts N copies of the same
``hybridrl train``; each reads ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` from the environment.
Nothing here launches processes or re-implements collectives: these are thin helpers over
``torch.distributed`` that are the identity on a single process, so the trainer calls them
unconditionally. Collective helpers move their data through CPU tensors (the process group
has a gloo backend for CPU tensors beside nccl for CUDA ones).

This module holds collectives and facts about ranks only, and imports nothing of hybridrl (the
GPU benchmark uses it bare).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

_owned = False  # whether setup() created the process group (and teardown() should destroy it)
_keeps_teardown = False  # keep_teardown(): the process must not skip the interpreter's teardown


# -- the process group ----------------------------------------------------------------------


def env_world() -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` as torchrun sets them; ``(0, 1, 0)`` without torchrun."""
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("LOCAL_RANK", 0)),
    )


def setup(device: torch.device, need_group: bool = False, timeout_s: float = 1800) -> None:
    """Join the process group torchrun describes (``WORLD_SIZE`` > 1), once.

    gloo serves CPU tensors and, on GPUs, nccl serves CUDA tensors (``cpu:gloo,cuda:nccl``),
    so small CPU collectives and CPU-offloaded parameters work beside GPU training.
    ``need_group``: create a group of one when there is no torchrun (a sharded strategy on one
    process).
    """
    global _owned
    if dist.is_available() and dist.is_initialized():
        return
    rank, world, _ = env_world()
    if world == 1 and not need_group:
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    kwargs = {"timeout": timedelta(seconds=timeout_s)}
    if world == 1 and "MASTER_ADDR" not in os.environ:
        kwargs |= {"store": dist.HashStore(), "rank": 0, "world_size": 1}
    dist.init_process_group(backend, **kwargs)
    _owned = True


def teardown(together: bool = False) -> None:
    """Leave the process group if :func:`setup` created it. ``together``: the run ended normally on
    every rank, so each waits for the others first and none tears its connections down while another
    still works (a rank that left while rank 0 was still writing the final checkpoint was seen to abort
    at its exit under torchrun with gloo: SIGABRT, 'terminate called without an active exception')."""
    global _owned
    if _owned and dist.is_initialized():
        if together:
            barrier()
        dist.destroy_process_group()
    _owned = False


def keep_teardown() -> None:
    """This process holds what the interpreter's teardown must release (an in-process vLLM engine's
    shared memory): its rank ends normally, never through :func:`exit_rank`."""
    global _keeps_teardown
    _keeps_teardown = True


def end_rank(ranks: int, code: int) -> int:
    """A finished run's exit ``code``; under torchrun (``ranks`` > 1), unless :func:`keep_teardown`
    was called, the process ends here through :func:`exit_rank`."""
    if ranks > 1 and not _keeps_teardown:
        exit_rank(code)
    return code


def exit_rank(code: int) -> NoReturn:
    """End a torchrun rank's process with ``code``, its work done and its group left: output flushed,
    then ``os._exit``, without the interpreter's teardown. There, under torchrun with gloo, a rank
    that had finished its run was seen to abort now and then (SIGABRT, 'terminate called without an
    active exception': a thread of torch's native code destroyed while still joinable), and torchrun
    then reports the finished run as failed. Only for ranks that hold nothing the teardown must
    release: an in-process vLLM engine frees its shared memory there (/dev/shm), and a rank that
    skipped it left segments that the next run's engine could not create again (EEXIST)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if initialized() else 1


def is_main() -> bool:
    """Whether this process writes logs, samples, checkpoints' shared files and prints."""
    return rank() == 0


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


@contextlib.contextmanager
def main_first() -> Iterator[None]:
    """Rank 0 runs the block first (e.g. converting a model into a shared cache), then the others."""
    if not is_main():
        barrier()
    yield
    if is_main():
        barrier()


# -- small collectives (identity on one process) --------------------------------------------


def broadcast_object(obj):
    """Rank 0's ``obj`` on every rank."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_objects(obj) -> list:
    """Every rank's ``obj``, in rank order."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce(values: list[float], op: str = "sum") -> list[float]:
    """Element-wise sum, max or min of a few numbers over ranks."""
    if world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return t.tolist()


def sum_over_ranks(value: float) -> float:
    return all_reduce([float(value)])[0]


def mean_over_ranks(value: float) -> float:
    return sum_over_ranks(value) / world_size()


def any_rank(flag: bool) -> bool:
    """True on every rank when it is true on one: ranks must take the same branches around collectives."""
    return all_reduce([float(bool(flag))], "max")[0] > 0


def all_ranks(flag: bool) -> bool:
    return all_reduce([float(bool(flag))], "min")[0] > 0


def all_gather_cat(t: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's 1-D tensor (sizes may differ), in rank order, on the CPU."""
    if world_size() == 1:
        return t
    return torch.cat([torch.as_tensor(x) for x in all_gather_objects(t.detach().cpu())])


def gather_lists(rows: list) -> list:
    """Every rank's list, concatenated in rank order (on every rank)."""
    if world_size() == 1:
        return rows
    return [r for part in all_gather_objects(rows) for r in part]


# -- splitting a step across ranks ----------------------------------------------------------


def my_share(items: list) -> list:
    """This rank's contiguous slice of the step's prompts (the count divides by the world size)."""
    world, r = world_size(), rank()
    if len(items) % world:
        raise ValueError(f"{len(items)} prompts cannot be split evenly over {world} ranks.")
    k = len(items) // world
    return items[r * k : (r + 1) * k]


def my_range(count: int) -> range:
    """This rank's contiguous part of ``count`` items that need not divide by the world size (an
    evaluation set): the ranks' parts differ by at most one item, in rank order."""
    world, r = world_size(), rank()
    return range(r * count // world, (r + 1) * count // world)


def masked_mean_var(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased variance of ``values`` (B, T) over ``mask`` and over every rank: for
    whitening advantages over the global batch (REINFORCE++, PPO) rather than per rank."""
    m = mask.to(values.dtype)
    s, s2, n = (values * m).sum().item(), (values.square() * m).sum().item(), m.sum().item()
    s, s2, n = all_reduce([s, s2, n])
    mean = s / max(n, 1e-8)
    var = (s2 - n * mean * mean) / max(n - 1, 1e-8)
    return torch.tensor(mean, dtype=values.dtype), torch.tensor(var, dtype=values.dtype)


# -- where each rank is, for failure reports ------------------------------------------------

_FAILURE_TEXT = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "timeout", "broken pipe")


def _store():
    """The launcher's key-value store (torchrun's rendezvous store), or None."""
    if world_size() == 1:
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


def heartbeat(step: int, stage: str) -> None:
    """Record in the store that this rank entered ``stage`` of ``step`` (cheap: one small write)."""
    store = _store()
    if store is not None:
        with contextlib.suppress(Exception):
            store.set(f"hybridrl/at/{rank()}", json.dumps([time.time(), step, stage]))


def whereabouts() -> dict[int, tuple[float, int, str]]:
    """rank -> (time, step, stage) of each rank's last :func:`heartbeat`."""
    store, out = _store(), {}
    if store is None:
        return out
    for r in range(world_size()):
        key = f"hybridrl/at/{r}"
        with contextlib.suppress(Exception):
            if store.check([key]):
                t, step, stage = json.loads(store.get(key))
                out[r] = (float(t), int(step), str(stage))
    return out


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is a collective that failed or timed out."""
    while error is not None:
        if isinstance(error, getattr(dist, "DistError", ())) or any(t in str(error).lower() for t in _FAILURE_TEXT):
            return True
        error = error.__cause__
    return False


def describe_failure(error: BaseException, step: int, timeout_s: float) -> str:
    """An error message naming the rank that most likely died or stalled, and each rank's stage."""
    now, me, seen = time.time(), rank(), whereabouts()
    mine = seen.get(me, (now, step, "?"))
    others = {r: v for r, v in seen.items() if r != me}
    lines = ", ".join(f"rank {r} in '{st}' of step {s} {now - t:.1f} s ago" for r, (t, s, st) in sorted(seen.items()))
    missing = [r for r in range(world_size()) if r not in seen]
    suspect = min(others, key=lambda r: (others[r][1], others[r][0])) if others else (missing[0] if missing else None)
    blame = (
        f"rank {suspect} most likely died or stalled (see its own log)"
        if suspect is not None
        else "another rank failed"
    )
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (
        f"step {step}: rank {me} lost the other ranks in stage '{mine[2]}' ({first}); {blame}. Last seen: {lines}. "
        f"Collectives wait trainer.timeout_s={timeout_s:g} s for a rank that stalls; torchrun stops the job when "
        "a rank exits."
    )


class RankFailure(RuntimeError):
    """A collective failed because another rank died or stalled; the message names it."""
