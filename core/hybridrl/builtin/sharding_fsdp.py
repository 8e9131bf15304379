"""Sharding strategy ``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``) over the ranks
of a torchrun launch.

Each transformer block is sharded on its own (found from the model: its ``_no_split_modules``
class names, else the layers of its largest ``ModuleList``), then the root, so one block's
parameters are gathered at a time. Full tensors for the rollout engine are gathered one
parameter at a time; checkpoints keep each rank's shards with torch.distributed.checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field

from hybridrl import distributed as dist
from hybridrl.components import Options, ShardingStrategy
from hybridrl.hookspecs import hookimpl
from hybridrl.models import compute_dtype, enable_activation_checkpointing, find_blocks, master_weights

NAME = "sharding strategy 'fsdp'"


def full_tensor(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The whole of a (possibly sharded) tensor; a collective when it is a DTensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t.detach()
    if t.device != device:  # CPU-offloaded shard: gather on the compute device
        t = DTensor.from_local(
            t.to_local().to(device), t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        )
    return t.full_tensor().detach()


class FSDPStrategy(ShardingStrategy):
    """FSDP2 over the ranks of a torchrun launch (a process group of one without torchrun)."""

    multi_process = True

    class Options(Options):
        mode: Literal["full_shard", "shard_grad_op", "hybrid_shard"] = Field(
            "full_shard",
            description="full_shard: parameters, gradients and optimizer state sharded over all ranks, "
            "parameters freed again after each block's forward; shard_grad_op: the same but parameters stay "
            "gathered from forward to backward (more memory, fewer all-gathers); hybrid_shard: full_shard "
            "within groups of shard_group_size ranks, replicated across groups (2-D mesh).",
        )
        shard_group_size: int | None = Field(
            None,
            gt=0,
            description="hybrid_shard: ranks per shard group (it must divide the world size); default: the "
            "processes of one node (LOCAL_WORLD_SIZE), so all-gathers stay inside a node.",
        )
        mixed_precision: Literal["auto", "off", "bf16"] = Field(
            "auto",
            description="bf16: compute in bfloat16 while the trained model's parameters and optimizer state stay "
            "float32 and gradients are reduced in float32; auto: model.dtype when it is bfloat16 or float16 "
            "(float32 master weights), else bf16 on a CUDA GPU that supports it, else off; off: float32 compute "
            "(refused with a 16-bit model.dtype).",
        )
        offload: bool = Field(
            False,
            description="Keep parameters, gradients and optimizer state in CPU memory between uses "
            "(CPUOffloadPolicy); the optimizer step then runs on the CPU. Needs a CUDA device.",
        )
        activation_checkpointing: bool = Field(
            False,
            description="Recompute each block's activations in the backward pass instead of keeping them "
            "(the model's own gradient checkpointing, non-reentrant).",
        )
        blocks: list[str] | None = Field(
            None,
            description="Class names of the modules to shard one by one; default: the model's "
            "_no_split_modules, else the entries of its largest ModuleList.",
        )

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        o = options
        self.compute_dtype = compute_dtype(o.mixed_precision, ctx.dtype, ctx.device, "sharding.mixed_precision")
        if o.offload and ctx.device.type != "cuda":
            raise ValueError(
                f"sharding.offload moves parameters off the GPU between uses, but the policy is on "
                f"{ctx.device} (trainer.device). Remove sharding.offload on a CPU run."
            )
        if o.shard_group_size and o.mode != "hybrid_shard":
            raise ValueError(f"sharding.shard_group_size is for mode hybrid_shard (mode is {o.mode}); remove it.")
        dist.setup(ctx.device, need_group=True)
        self._mesh = None

    @property
    def mesh(self):
        """The device mesh: 1-D over all ranks, or (replicate, shard) for hybrid_shard."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            world, kind = dist.world_size(), self.ctx.device.type
            if self.options.mode == "hybrid_shard":
                size = self.options.shard_group_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
                if world % size:
                    raise ValueError(
                        f"sharding.shard_group_size={size} does not divide the {world} ranks; use a divisor of {world}."
                    )
                self._mesh = init_device_mesh(kind, (world // size, size), mesh_dim_names=("replicate", "shard"))
            else:
                self._mesh = init_device_mesh(kind, (world,), mesh_dim_names=("shard",))
        return self._mesh

    def _policies(self) -> dict:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        kwargs = {"mesh": self.mesh, "reshard_after_forward": self.options.mode != "shard_grad_op"}
        if self.compute_dtype is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        if self.options.offload:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
        return kwargs

    def checkpoints_activations(self) -> bool:
        return self.options.activation_checkpointing

    def wrap(self, model, trainable=True):
        from torch.distributed.fsdp import fully_shard

        blocks = find_blocks(model, self.options.blocks)
        if not blocks:
            raise ValueError(
                f"{NAME}: found no blocks to shard in {type(model).__name__} (no _no_split_modules, no "
                "ModuleList). Set sharding.blocks to the class names of its layers."
            )
        if trainable:
            master_weights(model)
        if self.options.activation_checkpointing and trainable:
            enable_activation_checkpointing(model, "sharding.activation_checkpointing")
        kwargs = self._policies()
        for block in reversed(blocks):  # inner modules before the ones that hold them
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        return model

    def input_device(self, model):
        return self.ctx.device  # parameters may sit in CPU memory (offload); compute is here

    def full_tensors(self, model, keep=None):
        # one parameter gathered at a time: the extra memory is that of the largest tensor
        for name, t in model.state_dict().items():
            if keep is None or keep(name):  # the same names on every rank: the gathers stay in step
                yield name, full_tensor(t, self.ctx.device)

    def save_model(self, model, path):
        """Gather the full weights on rank 0 (CPU) and write them as a plain HF folder there."""
        main = dist.is_main()
        state: dict[str, torch.Tensor] = {}
        first: dict[int, str] = {}  # tied weights: one tensor under each of its names
        for name, p in model.state_dict(keep_vars=True).items():
            if id(p) in first:
                if main:
                    state[name] = state[first[id(p)]]
                continue
            first[id(p)] = name
            full = full_tensor(p, self.ctx.device)
            if main:
                state[name] = full.cpu()
            del full
        if main:
            model.save_pretrained(path, state_dict=state)
        dist.barrier()

    def load_model(self, model, path):
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        state = {}
        for f in sorted(Path(path).glob("*.safetensors")):
            state.update(load_file(f))
        if not state:
            raise FileNotFoundError(f"{NAME}: no *.safetensors files in {path}.")
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))

    def save_sharded(self, model, optimizer, path):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(path))
        return True

    def load_sharded(self, model, optimizer, path):
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from hybridrl.sharded_checkpoint import load_distributed

        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        load_distributed(state, Path(path))  # dcp.load, but its pickles build no code: a crafted .metadata runs nothing
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    def clip_grad_norm(self, model, max_norm):
        from torch.distributed.tensor import DTensor

        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)  # the norm of the DTensor grads: over all ranks
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)


@hookimpl
def register_sharding_strategies(register):
    register("fsdp", FSDPStrategy)
