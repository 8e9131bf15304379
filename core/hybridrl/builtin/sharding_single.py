"""Sharding strategy ``single``: the whole model on this process's one device."""

from __future__ import annotations

import contextlib
from typing import Literal

import torch
from pydantic import Field

from hybridrl.compile import compile_blocks, pays_back
from hybridrl.components import ShardingOptions, ShardingStrategy
from hybridrl.hookspecs import hookimpl
from hybridrl.models import compute_dtype, enable_activation_checkpointing, master_weights
from hybridrl.packing import pack_width


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
        compile: Literal["auto", "on", "off"] = Field(
            "auto",
            description="torch.compile each transformer block of the policy and the reference model (fuses "
            "norms, rotary embeddings and activations; one graph for every number of rows, packed rows kept "
            "one width) and fuse the output layer's log-softmax, gather and entropy. The first step compiles "
            "(about 30 s for a 0.5B model on an H200; a second run on the machine reuses torch's cache). "
            "'auto': on a CUDA GPU when the run trains enough tokens to pay that back (trainer.steps x "
            "responses a step x (longest prompt + rollout.max_tokens) of at least 4M, or no trainer.steps), "
            "off elsewhere.",
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
        self.compiles = compiles(options.compile, ctx)
        #: with compile, the passes compute the output layer's logprobs and entropies with compiled, fused
        #: kernels (hybridrl.forward.chunked_head_logprobs), keeping a pass's logits up to this many bytes
        #: for the backward pass; the pass runner gives it to the handle of each model it runs
        self.fused_head_bytes = int(options.keep_logits_gib * 2**30) if self.compiles else None
        if self.compiles and ctx.prompt_tokens and ctx.response_tokens:
            self.pack_width = pack_width(ctx.prompt_tokens + ctx.response_tokens)

    def wrap(self, model, trainable=True):
        model = (master_weights(model) if trainable else model).to(self.ctx.device)
        if trainable and self.options.activation_checkpointing:
            enable_activation_checkpointing(model, "sharding.activation_checkpointing")
        if self.compiles:  # the reference model too: its forward pass is half of the logprobs stage
            compile_blocks(model)
        return model

    def checkpoints_activations(self) -> bool:
        return self.options.activation_checkpointing

    def autocast(self):
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=self.compute_dtype)

    def full_tensors(self, model, keep=None):
        # tied weights appear once, under the name the HF state dict uses
        yield from ((n, t) for n, t in model.state_dict().items() if keep is None or keep(n))


# sharding.compile auto: the update and logprob passes compiled took 0.70 s a step against 0.93 s at 64 x 384
# tokens (0.5B shape, H200, 2026-12-01), and 3.09 s against 5.11 s at 512 x 384: about 10 us a trained token,
# so the first step's ~30 s of compiling pays back after some 3M tokens
COMPILE_PAYS_TOKENS = 4_000_000


def compiles(choice: str, ctx) -> bool:
    """Whether sharding.compile ``choice`` compiles the run's blocks (see the option); 'auto' says so once."""
    tokens = (ctx.prompt_tokens or 0) + (ctx.response_tokens or 0)  # the longest sequence
    planned = ctx.steps * (ctx.responses_per_call or 0) * tokens if ctx.steps else None
    counted = "trained tokens (trainer.steps x responses x (prompt + max_tokens))"
    return pays_back(choice, "sharding.compile", ctx, planned, COMPILE_PAYS_TOKENS, counted)


@hookimpl
def register_sharding_strategies(register):
    register("single", SingleDevice)
