"""Writing the trainer's weights for vLLM: safetensors bytes for worker processes, a folder for a server;
vLLM's warnings of a partial reload kept quiet."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

from hybridrl.engines import tensor_bytes, weight_buckets

Named = tuple[str, torch.Tensor]


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


TIED_SHARD = "model-tied-head.safetensors"
EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")


def write_hf_folder(
    named_tensors: Iterable[Named], source: str, dest: Path, limit_bytes: float, tied_head: bool = False
) -> Path:
    """Write the tensors as sharded safetensors (one shard per bucket) plus the source's config;
    with ``tied_head``, the input embedding also as ``lm_head.weight`` in a shard of its own
    (:data:`TIED_SHARD`), which :func:`drop_tied_head` takes out again.

    The folder appears atomically: written beside ``dest``, then renamed over it, so a server
    never reads half a checkpoint.
    """
    from safetensors.torch import save_file

    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map, total, embedding = {}, 0, None
    for i, bucket in enumerate(weight_buckets(named_tensors, limit_bytes)):
        shard = f"model-{i + 1:05d}.safetensors"
        tensors = to_safetensors_dict(bucket)
        save_file(tensors, str(tmp / shard), metadata={"format": "pt"})
        weight_map |= {name: shard for name in tensors}
        total += sum(tensor_bytes(t) for t in tensors.values())
        embedding = next((t for name, t in tensors.items() if name.endswith(EMBEDDINGS)), embedding)
        del tensors, bucket
    if tied_head and embedding is not None and "lm_head.weight" not in weight_map:
        save_file({"lm_head.weight": embedding.clone()}, str(tmp / TIED_SHARD), metadata={"format": "pt"})
        weight_map["lm_head.weight"] = TIED_SHARD
        total += tensor_bytes(embedding)
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


def drop_tied_head(folder: Path) -> None:
    """Take the tied output layer that :func:`write_hf_folder` added out of ``folder`` again."""
    folder = Path(folder)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    if index["weight_map"].pop("lm_head.weight", None) == TIED_SHARD:
        (folder / TIED_SHARD).unlink(missing_ok=True)
    index_path.write_text(json.dumps(index, indent=1))


class _DropPartialReloadWarnings(logging.Filter):
    """A bucket reloads some layers; vLLM warns about every other one, which is expected here."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not ("Failed to load weights" in msg or "were not loaded from checkpoint" in msg)


@contextlib.contextmanager
def quiet_partial_reload():
    handlers = logging.getLogger("vllm").handlers + logging.getLogger().handlers
    f = _DropPartialReloadWarnings()
    for h in handlers:
        h.addFilter(f)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(f)
