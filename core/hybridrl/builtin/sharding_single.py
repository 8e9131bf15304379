"""Sharding strategy ``single``: the whole model on this process's one device."""

from __future__ import annotations

import contextlib
from typing import Literal

import torch
from pydantic import Field

from hybridrl.components import ShardingOptions, ShardingStrategy
from hybridrl.hookspecs import hookimpl
from hybridrl.models import (
    allow_recompiles,
    compute_dtype,
    enable_activation_checkpointing,
    find_blocks,
    master_weights,
)


class SingleDevice(ShardingStrategy):
    class Options(ShardingOptions):
        mixed_precision: Literal["auto", "off", "bf16"] = Field(
            "auto",
            description="bf16: run the forward and backward passes under bfloat16 autocast while the trained "
            "model's parameters, gradients and optimizer state stay float32 (TRL's and accelerate's bf16); "
            "auto: model.dtype when it is bfloat16 or float16 (float32 master weights), else bf16 on a CUDA "
            "GPU that supports it, else off; off: float32 compute (refused with a 16-bit model.dtype).",
        )
        activation_checkpointing: bool = Field(
            False,
            description="Recompute each block's activations in the backward pass instead of keeping them "
            "(the model's own gradient checkpointing, non-reentrant): less memory, about a third more compute.",
        )
        compile: bool = Field(
            False,
            description="torch.compile each transformer block of the policy and the reference model (fuses "
            "norms, rotary embeddings and activations) and fuse the output layer's log-softmax, gather and "
            "entropy; the first steps compile, new lengths may recompile (torch.compile's recompile_limit is raised "
            "to 64 for the process, so that every variant of a pass keeps a compiled graph).",
        )
        keep_logits_gib: float = Field(
            8.0,
            ge=0,
            description="With compile: keep a forward pass's output-layer logits (response tokens x vocabulary, "
            "in the compute dtype) for the backward pass when they take at most this many GiB; larger ones are "
            "recomputed chunk by chunk (less memory, about 15% more update time for a 0.5B model on an H200).",
        )

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.compute_dtype = compute_dtype(options.mixed_precision, ctx.dtype, ctx.device, "sharding.mixed_precision")
        #: with compile, the passes compute the output layer's logprobs and entropies with compiled, fused
        #: kernels (hybridrl.forward.chunked_head_logprobs), keeping a pass's logits up to this many bytes
        #: for the backward pass; the pass runner gives it to the handle of each model it runs
        self.fused_head_bytes = int(options.keep_logits_gib * 2**30) if options.compile else None

    def wrap(self, model, trainable=True):
        model = (master_weights(model) if trainable else model).to(self.ctx.device)
        if trainable and self.options.activation_checkpointing:
            enable_activation_checkpointing(model, "sharding.activation_checkpointing")
        if self.options.compile:  # the reference model too: its forward pass is half of the logprobs stage
            allow_recompiles()
            for block in find_blocks(model):
                block.compile()
        return model

    def checkpoints_activations(self) -> bool:
        return self.options.activation_checkpointing

    def autocast(self):
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=self.compute_dtype)

    def full_tensors(self, model):
        # tied weights appear once, under the name the HF state dict uses
        yield from model.state_dict().items()


@hookimpl
def register_sharding_strategies(register):
    register("single", SingleDevice)
