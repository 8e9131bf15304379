"""LoRA through peft: only the adapters train, the reference is the base model with the adapter
off (no second copy), and engines receive merged weights under the base model's names.

``model.lora: {r, alpha, dropout, target_modules}`` in the run config. The policy is wrapped by
``peft.get_peft_model`` before the sharding strategy places it; its optimizer holds the adapters
only. Each weight sync streams ``W + scaling * B @ A`` for every adapted layer and the base
tensors as they are, named as in the base model's Hugging Face state dict, so every engine (hf,
vLLM, SGLang, a server) loads them as it loads a full model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from hybridrl.errors import ConfigError

PEFT_PREFIX = "base_model.model."
INSTALL = "pip install 'hybridrl[lora]' (peft)"


def import_peft():
    try:
        import peft
    except ImportError as e:
        raise ConfigError(f"model.lora needs peft ({e}). Install it with: {INSTALL}") from None
    return peft


def apply_lora(model: torch.nn.Module, options) -> torch.nn.Module:
    """``model`` with LoRA adapters on ``options.target_modules``; only the adapters train."""
    peft = import_peft()
    config = peft.LoraConfig(
        r=options.r,
        lora_alpha=options.alpha,
        lora_dropout=options.dropout,
        target_modules=options.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        return peft.get_peft_model(model, config)
    except ValueError as e:
        if "not found" not in str(e) and "target" not in str(e).lower():
            raise
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ConfigError(
            f"model.lora.target_modules {options.target_modules!r} match no layer of {type(model).__name__}. Its "
            f"linear layers are named: {', '.join(linear)} (or use 'all-linear')."
        ) from None


def is_lora(model: torch.nn.Module) -> bool:
    return any(".lora_A." in name for name, _ in model.named_parameters())


@contextlib.contextmanager
def adapter_off(model: torch.nn.Module):
    """The base model: forward passes inside run without the adapters (the reference policy)."""
    with model.disable_adapter():
        yield


def scalings(model: torch.nn.Module) -> dict[str, float]:
    """module name (peft's) -> the scaling of its adapter (alpha / r)."""
    from peft.tuners.lora import LoraLayer

    return {name: float(m.scaling["default"]) for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def merged_tensors(named: Iterable[tuple[str, torch.Tensor]], scaling: dict[str, float]) -> Iterator:
    """A LoRA model's full tensors (peft's names, any order within a layer) as the base model's:
    ``W + scaling * B @ A`` for each adapted layer; one layer held at a time."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        for role in (".base_layer.weight", ".lora_A.default.weight", ".lora_B.default.weight"):
            if name.endswith(role):
                layer = name[: -len(role)]
                got = parts.setdefault(layer, {})
                got[role] = tensor
                if len(got) == 3:
                    del parts[layer]
                    w = got[".base_layer.weight"]
                    delta = got[".lora_B.default.weight"].float() @ got[".lora_A.default.weight"].float()
                    yield base_name(layer + ".weight"), (w.float() + scaling[layer] * delta).to(w.dtype)
                break
        else:
            yield base_name(name.replace(".base_layer.", ".")), tensor
    if parts:
        raise RuntimeError(f"LoRA layers without all their parts in the weight stream: {sorted(parts)[:3]}")


def base_name(name: str) -> str:
    return name.removeprefix(PEFT_PREFIX)


def describe(model: torch.nn.Module, options, others=()) -> str:
    """What trains, for the run's start: the adapters and the AdamW state they keep, and the other
    models an algorithm trains (``others``: its Trainables), which LoRA does not touch."""
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    state, full = trained * 8 / 2**20, total * 8 / 2**20  # AdamW's two float32 moments
    lines = [
        f"LoRA r={options.r} alpha={options.alpha} on {options.target_modules}: {trained:,} of {total:,} parameters "
        f"train ({100 * trained / total:.2f}%); AdamW state {state:.1f} MiB instead of {full:.0f} MiB"
    ]
    for other in others:
        n = sum(p.numel() for p in other.model.parameters() if p.requires_grad)
        lines.append(
            f"note: model.lora applies to the policy; the {other.label} is a model of its own and trains in full "
            f"({n:,} parameters, {n * 16 / 2**30:.2f} GiB of float32 weights, gradients and AdamW state); shrink it "
            "with its own options (ppo: critic: false, or a small critic_path)."
        )
    return "\n".join(lines)
