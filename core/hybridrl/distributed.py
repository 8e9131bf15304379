"""torch.distributed for hybridrl: the process group that torchrun describes, and the few
collectives the SPMD loop needs.

``torchrun --nproc-per-node N`` (or its multi-node rendezvous) starts N copies of the same
``hybridrl train``; each reads ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` from the environment.
Nothing here launches processes or re-implements collectives: these are thin helpers over
``torch.distributed`` that are the identity on a single process, so the trainer calls them
unconditionally. Collective helpers move their data through CPU tensors (the process group
has a gloo backend for CPU tensors beside nccl for CUDA ones).

This module imports neither pydantic nor the config layer (the GPU benchmark uses it bare).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

_owned = False  # whether setup() created the process group (and teardown() should destroy it)


class DeviceError(RuntimeError):
    """Tensors met on different devices; the message names the component and the devices."""


# -- the process group ----------------------------------------------------------------------


def env_world() -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` as torchrun sets them; ``(0, 1, 0)`` without torchrun."""
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("LOCAL_RANK", 0)),
    )


def resolve_device(name: str, key: str = "trainer.device") -> torch.device:
    """The device for ``name`` on this process; under torchrun ``cuda`` means ``cuda:LOCAL_RANK``.

    ``auto`` is the rank's GPU when torch sees one, else the CPU. An explicit index
    (``cuda:1``) is kept as it is on one process; under torchrun every rank would pick that
    same GPU, so it is an error there.
    """
    _, world, local = env_world()
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"{key} is '{name}', which is not a device name. Use auto, cpu, cuda, cuda:1, ...") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(
                f"{key} is '{name}', but torch sees no CUDA device (torch {torch.__version__}). Use {key}=cpu."
            )
        if device.index is None:
            device = torch.device("cuda", local if world > 1 else torch.cuda.current_device())
        elif world > 1 and key == "trainer.device":
            raise ValueError(
                f"{key} is '{name}', but under torchrun each of the {world} ranks takes its own GPU "
                f"(cuda:LOCAL_RANK). Set {key}=cuda, and choose GPUs with CUDA_VISIBLE_DEVICES."
            )
        if device.index >= count:
            have = ", ".join(f"cuda:{i}" for i in range(count))
            raise ValueError(
                f"{key} is '{device}', which does not exist: torch sees {have}"
                + (f" (LOCAL_RANK={local}: run at most {count} processes per node)." if world > 1 else ".")
            )
    return device


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


def teardown() -> None:
    """Leave the process group if :func:`setup` created it."""
    global _owned
    if _owned and dist.is_initialized():
        dist.destroy_process_group()
    _owned = False


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


def reduce_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """One value per metric for the whole step: a mean over ranks, except ``*/max`` (max),
    ``*/min`` (min), ``timing/*`` (max: the slowest rank sets the pace) and ``throughput/*``
    (sum). Metrics that only some ranks have are reduced over those."""
    if world_size() == 1:
        return metrics
    merged: dict[str, list[float]] = {}
    for part in all_gather_objects({k: float(v) for k, v in metrics.items()}):
        for k, v in part.items():
            merged.setdefault(k, []).append(v)
    out = {}
    for k, vs in merged.items():
        if k.endswith("/max") or k.startswith("timing/"):
            out[k] = max(vs)
        elif k.endswith("/min"):
            out[k] = min(vs)
        elif k.startswith("throughput/"):
            out[k] = sum(vs)
        else:
            out[k] = sum(vs) / len(vs)
    return out


# -- splitting a step across ranks ----------------------------------------------------------


def my_share(items: list) -> list:
    """This rank's contiguous slice of the step's prompts (the count divides by the world size)."""
    world, r = world_size(), rank()
    if len(items) % world:
        raise ValueError(f"{len(items)} prompts cannot be split evenly over {world} ranks.")
    k = len(items) // world
    return items[r * k : (r + 1) * k]


def check_divisible(prompts_per_step: int, mini_batch_size: int | None, world: int) -> None:
    """Prompts (and the mini-batch) must split evenly over ranks; the error says what to set."""
    if prompts_per_step % world:
        raise ValueError(
            f"trainer.prompts_per_step={prompts_per_step} does not divide by the {world} ranks of this run "
            f"(torchrun --nproc-per-node x nodes): each rank takes whole prompts with all their samples. "
            f"Use a multiple of {world}."
        )
    if mini_batch_size and mini_batch_size % world:
        raise ValueError(
            f"trainer.mini_batch_size={mini_batch_size} does not divide by the {world} ranks of this run; "
            f"each rank trains on mini_batch_size / {world} responses per optimizer step. Use a multiple of {world}."
        )


def rollout_seed(seed: int, step: int) -> int:
    """The sampling seed of a step on this rank: ranks never draw identical samples."""
    return seed * 100_003 + step + 1_000_003 * rank()


def masked_mean_var(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased variance of ``values`` (B, T) over ``mask`` and over every rank: for
    whitening advantages over the global batch (REINFORCE++, PPO) rather than per rank."""
    m = mask.to(values.dtype)
    s, s2, n = (values * m).sum().item(), (values.square() * m).sum().item(), m.sum().item()
    s, s2, n = all_reduce([s, s2, n])
    mean = s / max(n, 1e-8)
    var = (s2 - n * mean * mean) / max(n - 1, 1e-8)
    return torch.tensor(mean, dtype=values.dtype), torch.tensor(var, dtype=values.dtype)


# -- device errors --------------------------------------------------------------------------

_DEVICE_ERROR = re.compile(
    r"Expected all tensors to be on the same device|is not on the expected device|"
    r"Expected .* to be on .* device|must be on the same device|device mismatch",
    re.IGNORECASE,
)
_DEVICE_NAME = re.compile(r"\b(cpu|meta|mps|xpu|cuda(?::\d+)?)\b")


def is_device_error(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and bool(_DEVICE_ERROR.search(str(error)))


@contextlib.contextmanager
def device_errors(component: str, placement: dict | Callable[[], dict], fix: str = "") -> Iterator[None]:
    """Turn torch's "Expected all tensors to be on the same device" inside the block into a
    :class:`DeviceError` naming the component, the devices torch found, and where each part
    was placed (``placement``: label -> device, e.g. ``{"its parameters": "cuda:1", "its inputs":
    "cuda:0"}``, or a function returning it, called only on an error)."""
    try:
        yield
    except RuntimeError as e:
        if not is_device_error(e) or isinstance(e, DeviceError):
            raise
        if callable(placement):
            placement = placement()
        found = sorted(set(_DEVICE_NAME.findall(str(e))))
        where = ", ".join(f"{label} on {dev}" for label, dev in placement.items() if dev is not None)
        raise DeviceError(
            f"{component}: tensors on different devices ({' and '.join(found) or 'see below'}); {where}. {fix}".rstrip()
            + f" [torch: {str(e).splitlines()[0]}]"
        ) from e
