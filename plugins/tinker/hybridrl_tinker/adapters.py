"""Adapters over one frozen base: every Tinker model (a LoRA training client) is a set of LoRA factors
with its own AdamW state, and the policy's LoRA layers hold one set at a time.

The run's policy is a peft model with one adapter (``model.lora``: its rank, alpha and layers). A
:class:`Slots` knows where each of its LoRA factors sits; :meth:`Slots.use` points those places at
another set's tensors (the same shapes), so a forward pass, a backward pass or a weight sync runs
with that set, and the base's weights are never copied. A :class:`Tenant` is one training client's
set, its optimizer and its step. Folders are peft's adapter folders (``adapter_config.json``,
``adapter_model.safetensors``; ``peft.PeftModel.from_pretrained`` and ``model.lora.path`` read them)
with, for a training state, ``optimizer.safetensors`` and ``state.json`` beside: nothing is pickled,
and a folder is written whole or not at all.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

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


class Slots:
    """The policy's LoRA factors by name (peft's, with the adapter ``default``): where each sits, so
    that another set of the same shapes can take its place (:meth:`use`)."""

    def __init__(self, policy: torch.nn.Module):
        self.policy, self.places = policy, {}
        for name, p in policy.named_parameters():
            if lora.adapted_layer_of(name):
                owner, attr = name.rsplit(".", 1)
                self.places[name] = (policy.get_submodule(owner), attr, tuple(p.shape), p.device)
        if not self.places:
            raise ValueError("the policy has no LoRA adapters: the Tinker server trains adapters (set model.lora)")
        self.config = lora.adapter_config(policy)
        self.rank = int(self.config["r"])
        self.layers = lora.adapted_layers(policy)

    def names(self) -> list[str]:
        return list(self.places)

    def fresh(self, seed: int | None, train: set[str]) -> dict[str, torch.nn.Parameter]:
        """A new set as peft starts one: A kaiming-uniform, B zero (an embedding's: A zero, B normal), so
        the model is the base; factors in the groups of ``train`` (:data:`GROUPS`) train, the others stay."""
        gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**63)
        out = {}
        for name, (_, _, shape, device) in self.places.items():
            t = torch.zeros(shape)
            if name.endswith(".lora_A.default.weight"):
                torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=gen)
            elif name.endswith(".lora_embedding_B.default"):
                torch.nn.init.normal_(t, generator=gen)
            out[name] = torch.nn.Parameter(t.to(device), requires_grad=group_of(name) in train)
        return out

    def use(self, tensors: dict[str, torch.Tensor]) -> None:
        """Point every LoRA factor of the policy at ``tensors`` (a full set, by name)."""
        for name, (owner, attr, _, _) in self.places.items():
            t = tensors[name]
            setattr(owner, attr, t if isinstance(t, torch.nn.Parameter) else torch.nn.Parameter(t, requires_grad=False))

    def adapter(self, tensors: dict[str, torch.Tensor], version: int) -> lora.Adapter:
        """``tensors`` as an engine loads an adapter (peft's saved names)."""
        return lora.Adapter(self.config, [(lora.saved_name(n), t.detach()) for n, t in tensors.items()], version)

    def check(self, tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
        """``tensors`` read from ``where``, refused unless they fit this base and rank."""
        missing = sorted(set(self.places) - set(tensors))
        wrong = [n for n, t in tensors.items() if n in self.places and tuple(t.shape) != self.places[n][2]]
        if missing or wrong:
            bad = (missing or wrong)[0]
            raise ValueError(
                f"the adapter at {where} does not fit this server's base model and rank {self.rank}: "
                f"{'no tensor' if missing else 'another shape'} for {lora.saved_name(bad)}"
            )
        return {n: tensors[n].to(self.places[n][3]) for n in self.places}


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
