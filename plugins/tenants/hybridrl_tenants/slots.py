"""Several sets of LoRA factors over one frozen base: the policy's LoRA layers hold one set at a time.

The run's policy is a peft model with one adapter (``model.lora``: its rank, alpha and layers).
:class:`Slots` knows where each of its LoRA factors sits; :meth:`Slots.use` points those places at
another set's tensors (the same shapes), so that a forward pass, a backward pass, a checkpoint or a
weight sync runs with that set, and the base's weights are never copied. ``hybridrl tinker`` keeps a
set per client, ``hybridrl tenants`` one per tenant, each with an optimizer of its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from hybridrl import lora


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
            raise ValueError("the policy has no LoRA adapters: set model.lora")
        self.config = lora.adapter_config(policy)
        self.rank = int(self.config["r"])
        self.layers = lora.adapted_layers(policy)

    def names(self) -> list[str]:
        return list(self.places)

    def current(self) -> dict[str, torch.nn.Parameter]:
        """A copy of the set the policy holds now, as trainable parameters of their own."""
        return {n: torch.nn.Parameter(getattr(o, a).detach().clone()) for n, (o, a, _, _) in self.places.items()}

    def fresh(self, seed: int | None, trainable: Callable[[str], bool] = lambda name: True) -> dict:
        """A new set as peft starts one: A kaiming-uniform, B zero (an embedding's: A zero, B normal), so
        the model is the base; the factors ``trainable(name)`` accepts train, the others stay."""
        gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**63)
        out = {}
        for name, (_, _, shape, device) in self.places.items():
            t = torch.zeros(shape)
            if name.endswith(".lora_A.default.weight"):
                torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=gen)
            elif name.endswith(".lora_embedding_B.default"):
                torch.nn.init.normal_(t, generator=gen)
            out[name] = torch.nn.Parameter(t.to(device), requires_grad=trainable(name))
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
                f"the adapter at {where} does not fit this base model and rank {self.rank}: "
                f"{'no tensor' if missing else 'another shape'} for {lora.saved_name(bad)}"
            )
        return {n: tensors[n].to(self.places[n][3]) for n in self.places}
