"""Streaming the trainer's weights in buckets of whole layers, and writing them for a server."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

Named = tuple[str, torch.Tensor]

# "model.layers.3.self_attn.q_proj.weight" -> "model.layers.3" (also GPT-2's h.N and blocks.N)
_LAYER = re.compile(r"^(.*?\.(?:layers|h|blocks)\.\d+)\.")


def layer_of(name: str) -> str:
    """The unit a tensor must be loaded with: its decoder layer, or the tensor itself.

    vLLM fuses a layer's projections (q/k/v into qkv_proj, gate/up into gate_up_proj) and its
    in-place reload (``reload_weights``) only finishes a fused module when all its parts arrive in
    one call; a bucket that ends inside a layer leaves the rest of that module uninitialised. So
    buckets never split a layer. (The model's ``load_weights`` copies each part into its slice on
    its own and would not need this; buckets respect layers for both methods.)
    """
    m = _LAYER.match(name)
    return m.group(1) if m else name


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def buckets(named_tensors: Iterable[Named], limit_bytes: float) -> Iterator[list[Named]]:
    """Group a stream of named tensors into lists of whole layers of about ``limit_bytes``.

    A bucket closes at the first layer boundary after it reaches the limit, so it holds at most
    the limit plus one layer. The stream is read lazily: only the current bucket is held.
    """
    bucket: list[Named] = []
    size, layer = 0, None
    for name, tensor in named_tensors:
        unit = layer_of(name)
        if bucket and unit != layer and size >= limit_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes(tensor)
        layer = unit
    if bucket:
        yield bucket


def to_safetensors_dict(bucket: list[Named]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors that do not share memory (safetensors refuses shared storage)."""
    out, seen = {}, set()
    for name, t in bucket:
        t = t.detach().to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            t = t.clone()
        seen.add(key)
        out[name] = t
    return out


def write_hf_folder(named_tensors: Iterable[Named], source: str, dest: Path, limit_bytes: float) -> Path:
    """Write the tensors as sharded safetensors (one shard per bucket) plus the source's config.

    The folder appears atomically: written beside ``dest``, then renamed over it, so a server
    never reads half a checkpoint.
    """
    from safetensors.torch import save_file

    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map, total = {}, 0
    for i, bucket in enumerate(buckets(named_tensors, limit_bytes)):
        shard = f"model-{i + 1:05d}.safetensors"
        tensors = to_safetensors_dict(bucket)
        save_file(tensors, str(tmp / shard), metadata={"format": "pt"})
        weight_map |= {name: shard for name in tensors}
        total += sum(nbytes(t) for t in tensors.values())
        del tensors, bucket
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    for name in ("config.json", "generation_config.json"):
        if (Path(source) / name).is_file():
            shutil.copy(Path(source) / name, tmp / name)
    old = dest.with_name(dest.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        dest.rename(old)
    tmp.rename(dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest
