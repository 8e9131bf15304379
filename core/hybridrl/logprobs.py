"""The logprobs stage: a model's logprobs of a batch's responses, in micro-batches, without gradients."""

from __future__ import annotations

import torch

from hybridrl.batch import Batch
from hybridrl.devices import model_device_errors
from hybridrl.memory import MicroBatches, consecutive, memory_errors, pass_fix, pass_sizes
from hybridrl.models import response_logprobs


@torch.no_grad()
def batch_logprobs(
    model, batch: Batch, strategy, passes: MicroBatches | None, temperature: float, component: str, device: torch.device
) -> torch.Tensor:
    """(B, T) logprobs of ``batch``'s responses under ``model`` at ``temperature``, computed in the
    trainer's micro-batches (``passes``; None: one pass) on the model's device, returned on
    ``device`` in the batch's order."""
    groups = passes.groups(batch) if passes is not None else consecutive(len(batch), None)
    T = batch["responses"].shape[1]
    inputs = strategy.input_device(model)  # the reference may live elsewhere (sharding.ref_device)
    parts = []
    with model_device_errors(component, model, inputs, device), strategy.autocast():
        for mb in (batch.select(g) for g in groups):
            fix = pass_fix(mb, passes.size if passes is not None else None)
            with memory_errors(f"the logprobs of the {component}", inputs, pass_sizes(mb), fix):
                parts.append(
                    response_logprobs(model, mb.input_ids.to(inputs), mb.attention_mask.to(inputs), T, temperature)[0]
                )
    out = torch.cat(parts).to(device)
    rows = torch.tensor([i for g in groups for i in g], device=out.device)
    return torch.empty_like(out).index_copy_(0, rows, out)  # back in the batch's order
