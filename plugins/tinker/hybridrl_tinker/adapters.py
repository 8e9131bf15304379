"""Adapters over one frozen base: every Tinker model (a LoRA training client) is a set of LoRA factors
with its own AdamW state, and the policy's LoRA layers hold one set at a time
(:class:`hybridrl_tenants.slots.Slots`). A :class:`Tenant` is one training client's set, its
optimizer and its step. Folders are peft's adapter folders (``adapter_config.json``,
``adapter_model.safetensors``; ``peft.PeftModel.from_pretrained`` and ``model.lora.path`` read them)
with, for a training state, ``optimizer.safetensors`` and ``state.json`` beside: nothing is pickled,
and a folder is written whole or not at all.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hybridrl_tenants.slots import Slots

from hybridrl import lora

# where a factor's layer sits, by a module name on its path (the families' names: Llama, Qwen, Gemma,
# Mistral, Phi (qkv_proj, gate_up_proj), GPT-2 (attn.c_attn, mlp.c_fc))
ATTENTION = ("self_attn", "attn", "attention", "self_attention")
MLP = ("mlp", "feed_forward", "block_sparse_moe", "experts")
GROUPS = ("attn", "mlp", "unembed")


def group_of(name: str) -> str:
    """``attn``, ``mlp`` or ``unembed`` (the output layer and the embeddings) for a factor's name."""
    parts = set(name.split("."))
    if parts & set(ATTENTION):
        return "attn"
    if parts & set(MLP):
        return "mlp"
    return "unembed"


@dataclass
class Tenant:
    """One training client: its factors (trainable where its groups train), AdamW over those, its step."""

    base_model: str
    params: dict[str, torch.nn.Parameter]
    train: set[str]
    step: int = 0
    optimizer: torch.optim.Optimizer | None = None
    metadata: dict = field(default_factory=dict)

    def __post_init__(self):
        trained = [p for p in self.params.values() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trained, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)

    def optim_step(self, adam: dict) -> dict[str, float]:
        """One AdamW step with the client's parameters (Tinker's ``AdamParams``: decoupled weight
        decay; ``grad_clip_norm`` 0: no clipping), then the gradients are cleared."""
        trained = [p for p in self.params.values() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(trained, adam["grad_clip_norm"] or float("inf"))
        for group in self.optimizer.param_groups:
            group.update(lr=adam["learning_rate"], betas=(adam["beta1"], adam["beta2"]))
            group.update(eps=adam["eps"], weight_decay=adam["weight_decay"])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"grad_norm": float(norm), "learning_rate": float(adam["learning_rate"])}

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.params.items()}


def write_folder(folder: Path, slots: Slots, tensors: dict, state: dict | None, optimizer=None, overwrite=False):
    """An adapter folder at ``folder``, whole or not at all (written beside, then renamed): the adapter,
    and with ``state`` the training state (``state.json``, ``optimizer.safetensors``: AdamW's moments
    and step of each trained factor)."""
    from safetensors.torch import save_file

    if folder.exists() and not overwrite:
        raise FileExistsError(f"a checkpoint named {folder.name!r} exists; save under another name or overwrite it")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        slots.adapter(tensors, 0).save(tmp)
        if state is not None:
            moments = {}
            names = {id(p): n for n, p in tensors.items()}
            for p, s in optimizer.state.items():
                for key in ("exp_avg", "exp_avg_sq"):
                    moments[f"{key}.{lora.saved_name(names[id(p)])}"] = s[key].detach().contiguous().cpu()
                state = state | {"adam_step": float(s["step"])}
            save_file(moments, tmp / "optimizer.safetensors")
            (tmp / "state.json").write_text(json.dumps(state, indent=1))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_folder(folder: Path, slots: Slots, where: str) -> dict[str, torch.Tensor]:
    """The adapter of ``folder`` as factors of this base (peft's injected names), checked."""
    from safetensors.torch import load_file

    saved = load_file(folder / "adapter_model.safetensors")
    names = {lora.saved_name(n): n for n in slots.places}
    return slots.check({names.get(n, n): t for n, t in saved.items()}, where)


def restore(folder: Path, slots: Slots, where: str, optimizer: bool) -> Tenant:
    """The training client saved in ``folder`` (:func:`write_folder` with a state); ``optimizer``:
    with its AdamW moments and step (else a fresh AdamW on the same factors)."""
    from safetensors.torch import load_file

    state = json.loads((folder / "state.json").read_text())
    tensors = read_folder(folder, slots, where)
    train = set(state["train"])
    params = {n: torch.nn.Parameter(t.float(), requires_grad=group_of(n) in train) for n, t in tensors.items()}
    tenant = Tenant(state["base_model"], params, train, int(state["step"]) if optimizer else 0)
    if optimizer:
        moments = load_file(folder / "optimizer.safetensors")
        for n, p in params.items():
            key = lora.saved_name(n)
            if p.requires_grad and f"exp_avg.{key}" in moments:
                tenant.optimizer.state[p] = {
                    "step": torch.tensor(state["adam_step"]),
                    "exp_avg": moments[f"exp_avg.{key}"].to(p.device),
                    "exp_avg_sq": moments[f"exp_avg_sq.{key}"].to(p.device),
                }
    return tenant
