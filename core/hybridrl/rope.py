"""Rotary positions as the rollout engine computes them: LongRoPE's one set of factors, and the rope
keys of first releases that transformers 5 refuses.

LongRoPE (Phi-3, Phi-3.5, Phi-4-mini) has two sets of frequencies: the short factors, for sequences
within ``original_max_position_embeddings``, and the long ones past it. Each side chooses differently:

- transformers, for each batch, by its largest position (so a sequence's logprobs depend on the
  longest sequence beside it);
- vLLM, once for the engine: long when its ``max_model_len`` passes the original length (its
  ``Phi3LongRoPEScaledRotaryEmbedding``, vLLM 0.10 and later), and for LongRoPE models its default
  ``max_model_len`` is the original length, so short unless the user asks for more;
- SGLang, for each forward batch, long when any position passes the original length.

The trainer's models use one set for every sequence (:func:`pin_long_rope`): the one the engine's
length selects (:meth:`hybridrl.components.RolloutEngine.context_length`; the model's own
``max_position_embeddings`` for an engine without a length of its own, like the ``hf`` engine, whose
model is pinned alike).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import shutil
import sys
import tempfile
import types
from pathlib import Path

import torch

REPAIR = 1  # bump when repaired_folder writes something different, so cached folders are rebuilt


def long_rope_original(config) -> int | None:
    """The original length of a LongRoPE model's ``config`` (transformers'), None for other models."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") != "longrope":
        return None
    return rope.get("original_max_position_embeddings")


def uses_long_factors(config, context: int | None) -> bool:
    """Whether an engine serving up to ``context`` tokens (None: the model's max_position_embeddings)
    computes a LongRoPE model with its long factors."""
    return (context or config.max_position_embeddings) > long_rope_original(config)


def pin_long_rope(model: torch.nn.Module, context: int | None = None) -> bool:
    """Give a LongRoPE model the one set of factors that an engine serving up to ``context`` tokens
    uses, for every sequence (again with another ``context``: the buffers change in place); returns
    whether the model is one.

    Pinned, the trainer, the reference and the hf engine compute what the engine samples with: on a
    tiny Phi-3 the rollout/trainer logprob difference falls from 4e-3 to that of float32 rounding,
    and from 15.9 nats where the engine's length selects the other set.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = getattr(model, "config", None)
    original = long_rope_original(config)
    if original is None:
        return False
    seq_len = original + 1 if uses_long_factors(config, context) else original
    for module in model.modules():
        if getattr(module, "rope_type", None) == "longrope" and hasattr(module, "original_inv_freq"):
            inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](module.config, module.inv_freq.device, seq_len=seq_len)
            with torch.no_grad():
                module.inv_freq.copy_(inv_freq)
            # transformers' per-batch switch picks long_inv_freq past the original length and
            # original_inv_freq below it: both are the pinned set
            module.long_inv_freq = module.original_inv_freq = module.inv_freq
            # and that switch reads the batch's largest position back to the host, which a CUDA graph
            # capture refuses (decoding on a GPU): the forward without the switch uses the pinned set
            module.forward = types.MethodType(inspect.unwrap(type(module).forward), module)
    # Phi-3's (and PhiMoE's) input preparation for generate drops the KV cache at the first token past
    # the original length, to recompute it with the long factors; pinned, nothing needs recomputing,
    # and generate would go on from an empty cache: the parent class's preparation keeps it
    cls = type(model)
    parent = super(cls, model)
    if "prepare_inputs_for_generation" in vars(cls) and hasattr(parent, "prepare_inputs_for_generation"):
        model.prepare_inputs_for_generation = parent.prepare_inputs_for_generation
    return True


def describe(config, context: int | None, engine: str) -> str:
    """One line on the set the trainer's models use, for a LongRoPE model ('' for other models)."""
    original = long_rope_original(config)
    if original is None or context is None:
        return ""
    which, than = ("long", "past") if uses_long_factors(config, context) else ("short", "within")
    return (
        f"model: LongRoPE's {which} factors for every sequence, as rollout engine '{engine}' computes them "
        f"(it serves up to {context} tokens, {than} the original {original})"
    )


# -- first releases' rope keys -------------------------------------------------------------------


def repaired_config(cfg: dict) -> dict | None:
    """``config.json``'s mapping as transformers 5 loads it, or None where it loads as it is.

    Phi-3's first releases (Phi-3-mini-128k, Phi-3-medium-128k) give ``rope_scaling: {type: su,
    short_factor, long_factor}`` and ``original_max_position_embeddings`` beside it, not in it.
    transformers 5 renames ``su`` to ``longrope`` after gathering the rope keys, so the original length
    never joins them, and its check refuses the config (KeyError: Missing required keys in
    `rope_parameters` for 'rope_type'='longrope': {'original_max_position_embeddings'}); vLLM and
    SGLang read the folder through the same config class."""
    rope = cfg.get("rope_scaling")
    if not isinstance(rope, dict) or rope.get("type", rope.get("rope_type")) != "su":
        return None
    if "original_max_position_embeddings" in rope or "original_max_position_embeddings" not in cfg:
        return None
    original = cfg["original_max_position_embeddings"]
    return {**cfg, "rope_scaling": {**rope, "original_max_position_embeddings": original}}


def loadable_folder(folder: Path, cache: Path) -> Path:
    """``folder``, or where its config needs :func:`repaired_config`, a folder under ``cache`` with
    the repaired ``config.json`` and links to every other file (made once, atomically; the
    checkpoint itself is never written). Such folders whose checkpoint is gone are removed then."""
    try:
        text = (folder / "config.json").read_text()
        fixed = repaired_config(json.loads(text))
    except (OSError, ValueError):  # the loaders say what is wrong with it
        return folder
    if fixed is None:
        return folder
    key = hashlib.sha1(f"{REPAIR}:{folder.resolve()}:{text}".encode()).hexdigest()[:12]
    out = cache / "models" / f"{folder.resolve().name}-rope-{key}"
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    for old in out.parent.glob("*-rope-*"):  # those of checkpoints since moved or removed: their links lead nowhere
        with contextlib.suppress(OSError):  # another process removed it first
            if any(f.is_symlink() and not f.exists() for f in old.iterdir()):
                shutil.rmtree(old, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        for f in folder.resolve().iterdir():
            if f.name != "config.json":
                (tmp / f.name).symlink_to(f)
        (tmp / "config.json").write_text(json.dumps(fixed, indent=2))
        os.rename(tmp, out)
    except BaseException:  # half made, or another process made it first: never left behind
        shutil.rmtree(tmp, ignore_errors=True)
        if (out / "config.json").is_file():
            return out
        raise
    print(
        f"model: {folder} gives rope_scaling type su with original_max_position_embeddings beside it, which "
        f"transformers 5 refuses; it loads through a copy of its config.json with the length inside, in {out} "
        "(the checkpoint is unchanged)",
        file=sys.stderr,
        flush=True,
    )
    return out
