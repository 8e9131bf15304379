"""The policy's weights as engines load them: the checkpoint's names and layouts, each tensor once.

Engines that load checkpoints (vLLM, SGLang, a server that reads a folder) expect the tensors a
model folder holds. The trainer holds transformers' modules, which differ in two ways:

- **Conversions.** transformers 5 converts some checkpoints as it loads them. Qwen3-MoE's and
  Mixtral's experts, one tensor per expert and projection in the checkpoint
  (``mlp.experts.3.gate_proj.weight``), become one fused tensor per layer
  (``mlp.experts.gate_up_proj``, (experts, 2 x intermediate, hidden)); Mixtral's
  ``block_sparse_moe`` is renamed ``mlp``. A fused tensor sent as it is reaches no parameter of the
  engine, or the wrong one. :func:`checkpoint_tensors` reverts the conversions with transformers'
  own ``revert_weight_conversion`` (what ``save_pretrained`` writes), one layer at a time.
- **Tied weights.** A tied output layer is the input embedding under a second name
  (``lm_head.weight``). Engines tie it themselves, and some have no module of that name at all
  (vLLM's Gemma-2): it is sent once, under the embedding's name.

Engines declare which format they load (:attr:`hybridrl.components.RolloutEngine.weight_format`):
``checkpoint`` (the default) or ``transformers`` (the ``hf`` engine, a transformers model itself).
LoRA's merge (:mod:`hybridrl.lora`) runs before this, so adapters reach engines as plain weights.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

import torch

from hybridrl.engines import layer_of

Named = tuple[str, torch.Tensor]
FORMATS = ("checkpoint", "transformers")


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft wrapper (or ``model`` itself)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def tied_aliases(model: torch.nn.Module) -> set[str]:
    """State-dict names of parameters that are another parameter of ``model`` (a tied output layer's)."""
    seen, aliases = set(), set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases.add(name)
        seen.add(id(param))
    return aliases


def has_conversions(model: torch.nn.Module) -> bool:
    """Whether transformers converts ``model``'s checkpoint as it loads it (fused experts, renames)."""
    found = getattr(model, "_weight_conversions", None)
    if found is None:  # built from a config, not loaded: the conversions its type would use
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
        except ImportError:  # transformers 4 converts nothing
            return False
        found = get_model_conversion_mapping(model, add_legacy=False)
    return bool(found)


def checkpoint_tensors(model: torch.nn.Module, named: Iterable[Named]) -> Iterator[Named]:
    """``named`` (the full tensors of ``model``'s state dict, base-model names, in state-dict order)
    in the checkpoint's format: transformers' conversions reverted layer by layer and tied aliases
    left out. One layer is held at a time."""
    base = base_model(model)
    aliases, convert = tied_aliases(base), has_conversions(base)
    for _, group in itertools.groupby(named, key=lambda item: layer_of(item[0])):
        tensors = {name: t for name, t in group if name not in aliases}
        if convert and tensors:
            from transformers.core_model_loading import revert_weight_conversion

            tensors = revert_weight_conversion(base, tensors)
        yield from tensors.items()


def engine_tensors(model: torch.nn.Module, named: Iterable[Named], weight_format: str) -> Iterable[Named]:
    """``named`` in the format an engine loads (one of ``FORMATS``)."""
    if weight_format == "transformers":
        return named
    if weight_format == "checkpoint":
        return checkpoint_tensors(model, named)
    raise ValueError(f"Unknown engine weight format '{weight_format}'. Available: {', '.join(FORMATS)}.")
