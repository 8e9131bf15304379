"""What rollout engines share: weight buckets for the sync, stop strings cut after the fact, and
whether an engine on the policy's GPU may keep its memory while the policy trains."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch

Named = tuple[str, torch.Tensor]

# "model.layers.3.self_attn.q_proj.weight" -> "model.layers.3" (also GPT-2's h.N and blocks.N)
_LAYER = re.compile(r"^(.*?\.(?:layers|h|blocks)\.\d+)\.")


def layer_of(name: str) -> str:
    """The unit a tensor is sent with: its decoder layer, or the tensor itself.

    Engines fuse a layer's projections (vLLM: q/k/v into qkv_proj, gate/up into gate_up_proj),
    and vLLM's in-place reload only finishes a fused module when all its parts arrive in one
    call; a bucket that ends inside a layer would leave the rest of that module uninitialised.
    So buckets never split a layer.
    """
    m = _LAYER.match(name)
    return m.group(1) if m else name


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def weight_buckets(
    named_tensors: Iterable[Named], limit_bytes: float, skip: Iterable[str] = (), drop_aliases: bool = False
) -> Iterator[list[Named]]:
    """Group a stream of named tensors into lists of whole layers of about ``limit_bytes``.

    A bucket closes at the first layer boundary after it reaches the limit, so it holds at most
    the limit plus one layer. The stream is read lazily: only the current bucket is held. Names in
    ``skip`` are dropped; with ``drop_aliases`` so is a tensor that is the very memory of one
    already sent (a tied weight under its second name).
    """
    skip, seen = set(skip), set()
    bucket: list[Named] = []
    size, layer = 0, None
    for name, tensor in named_tensors:
        if name in skip:
            continue
        if drop_aliases and tensor.numel():
            key = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
            if key in seen:
                continue
            seen.add(key)
        unit = layer_of(name)
        if bucket and unit != layer and size >= limit_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor_bytes(tensor)
        layer = unit
    if bucket:
        yield bucket


def stop_length(ids: list[int], decode: Callable[[list[int]], str], stops: list[str]) -> int | None:
    """Length of ``ids`` up to and including the token that completes a stop string, or None.

    One decode when no stop string occurs; otherwise a binary search over prefixes.
    """
    if not stops or not ids or not any(s in decode(ids) for s in stops):
        return None
    lo, hi = 1, len(ids)  # the shortest prefix that contains a stop string lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in decode(ids[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return lo


AWAKE_ROOM = 0.25  # of the GPU, left for the training passes beside an engine that stays awake


def stays_awake(share: float, ctx) -> tuple[bool, str]:
    """Whether an engine that holds ``share`` of the policy's GPU (``ctx.device``) may keep it while
    the policy trains: when that share and the policy's training state while it updates
    (``ctx.training_memory``) leave ``AWAKE_ROOM`` of the GPU for the passes, whose micro-batches
    size themselves from what is free. Sleeping costs every step a release, a resume, and the
    passes' allocations after it. Returns the answer and the figures behind it, for the message."""
    total = torch.cuda.get_device_properties(ctx.device).total_memory
    if ctx.training_memory is None:  # nothing trains beside it (an evaluation)
        return True, "nothing trains beside it"
    state = ctx.training_memory.during_update
    room = 0.95 * total - share * total - state
    gib = 2**30
    why = (
        f"the engine's {share * total / gib:.1f} GiB ({share:g} of {ctx.device}) and the policy's training state "
        f"({state / gib:.1f} GiB) leave {max(room, 0) / gib:.1f} GiB for the training passes, "
        + ("a quarter of the GPU or more" if room >= AWAKE_ROOM * total else "less than a quarter of the GPU")
    )
    return room >= AWAKE_ROOM * total, why


def lora_plan(ctx, engine: str) -> tuple[dict, str | None]:
    """For an engine that serves LoRA adapters through its own LoRA support: the model's
    config.json, and why the run will not sync adapters to it (None: it may; the engine checks
    the rest)."""
    import json
    from pathlib import Path

    if ctx.lora is None:
        return {}, "the run trains no adapters"
    if ctx.lora.sync == "merged":
        return {}, "model.lora.sync: merged"
    config = json.loads((Path(ctx.model_path) / "config.json").read_text())
    if any(config.get(k) for k in ("num_local_experts", "num_experts")):
        return config, f"adapters of mixture-of-experts models are not served through {engine}'s LoRA here yet"
    return config, None
