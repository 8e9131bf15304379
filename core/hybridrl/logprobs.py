"""The logprobs stage: a model's logprobs of a batch's responses, in micro-batches, without gradients."""

from __future__ import annotations

import torch

from hybridrl.batch import Batch
from hybridrl.devices import model_device_errors
from hybridrl.memory import MicroBatches, consecutive, per_pass
from hybridrl.models import can_pack, response_logprobs


@torch.no_grad()
def batch_logprobs(
    model,
    batch: Batch,
    strategy,
    passes: MicroBatches | None,
    temperature: float,
    component: str,
    device: torch.device,
    share_prompts: bool = True,
    pack: bool = False,
) -> torch.Tensor:
    """(B, T) logprobs of ``batch``'s responses under ``model`` at ``temperature``, computed in the
    trainer's micro-batches (``passes``; None: one pass) on the model's device, returned on
    ``device`` in the batch's order; ``share_prompts`` and ``pack``: see :func:`response_logprobs`."""
    pack = pack and not share_prompts and can_pack(model)
    groups = passes.groups(batch, pack) if passes is not None else consecutive(len(batch), None)
    T = batch["responses"].shape[1]
    inputs = strategy.input_device(model)  # the reference may live elsewhere (sharding.ref_device)
    size = passes.size if passes is not None else None

    def forward(mb):
        ids, mask = mb.input_ids.to(inputs), mb.attention_mask.to(inputs)
        return response_logprobs(model, ids, mask, T, temperature, share_prompts=share_prompts, pack=pack)[0]

    with model_device_errors(component, model, inputs, device), strategy.autocast():
        return per_pass(batch, groups, f"the logprobs of the {component}", inputs, size, forward).to(device)
