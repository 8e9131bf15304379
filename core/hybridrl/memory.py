"""Memory: how many tokens a forward/backward pass may take, and out-of-memory errors that say
what to change.

``trainer.micro_batch_tokens: auto`` (the default) measures the device's free memory the first
time the trainer runs a pass, after the models and the engine are loaded and the engine has
released its memory for training (or kept it, where it stays awake), and gives each pass the
share of it its activations need:

    budget = AUTO_FRACTION x free bytes / bytes a token's activations take (at most)

A token's activations, for a decoder of L layers of width h with a gated MLP of width I, held
for the backward pass in the compute dtype (b bytes an element), are about (17 h + 6 I) b per
layer: the attention's inputs, queries, keys, values and output (about 11 h with SDPA, which
keeps no score matrix), the norms' inputs (4 h), the MLP's input (2 h) and its gate, up and
activation outputs (3 I, twice for the backward of the product) -- Korthikanti et al. 2022
(arXiv:2205.05198) count 34 h bytes at b = 2 for the 4 h MLP of GPT. With activation
checkpointing a layer keeps its input only (h b), plus one layer recomputed at a time. The
output layer adds the logits in the compute dtype and their float32 log-softmax and gradient:
V (b + 8) bytes, counted for every token although only response tokens reach it. On the CPU
``auto`` keeps the whole mini-batch in one pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from hybridrl import distributed
from hybridrl.batch import Batch
from hybridrl.errors import StageError

AUTO_FRACTION = 0.8  # of the free memory; the estimate is an upper bound (see docs/performance.md)
GIB = 2**30


class OutOfMemory(StageError):
    """A stage ran out of device memory; the message names the stage, the sizes and what to change."""


def bytes_per_token(config, compute_bytes: int, checkpointing: bool = False) -> int:
    """Bytes of activations a token keeps for the backward pass of ``config``'s model (see above)."""
    config = config.get_text_config()  # a multimodal model's language model
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    inner = getattr(config, "intermediate_size", None) or 4 * h
    layer = (17 * h + 6 * inner) * compute_bytes
    kept = h * compute_bytes * layers + layer if checkpointing else layer * layers
    return kept + vocab * (compute_bytes + 8)


def free_bytes(device: torch.device) -> int | None:
    """Memory a pass can still take on ``device``: free on the GPU plus what torch's cache holds
    unused; None on the CPU (no budget there)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def describe(device: torch.device) -> str:
    if device.type != "cuda":
        return str(device)
    total = torch.cuda.get_device_properties(device).total_memory
    return f"{device} ({torch.cuda.memory_allocated(device) / GIB:.1f} of {total / GIB:.1f} GiB allocated)"


class MicroBatches:
    """How much a pass may take: ``trainer.micro_batch_size`` responses, or
    ``trainer.micro_batch_tokens`` tokens (an int, or ``auto``), or the whole batch. The pass
    planner (:class:`hybridrl.passes.Planner`) cuts the passes from it."""

    def __init__(self, size: int | None, tokens: int | str | None, model_config, strategy, device: torch.device):
        self.size, self.tokens, self.device = size, None if size else tokens, device
        self.model_config, self.strategy = model_config, strategy

    def budget(self) -> int | None:
        """Tokens a pass may take; ``auto`` is measured on the first call and kept for the run."""
        if self.tokens == "auto":
            free = free_bytes(self.device)
            self.tokens = None if free is None else self._auto(free)
        return self.tokens

    def _auto(self, free: int) -> int:
        compute = self.strategy.compute_dtype or self.strategy.ctx.dtype
        checkpointing = self.strategy.checkpoints_activations()
        per_token = bytes_per_token(self.model_config, torch.empty(0, dtype=compute).element_size(), checkpointing)
        budget = int(distributed.all_reduce([AUTO_FRACTION * free / per_token], "min")[0])
        if distributed.is_main():
            print(
                f"micro-batches: up to {budget:,} tokens a pass ({free / GIB:.1f} GiB free on {self.device}, "
                f"about {per_token / 2**20:.2f} MiB of activations a token); set trainer.micro_batch_tokens "
                "or trainer.micro_batch_size to choose",
                flush=True,
            )
        return max(budget, 1)


def width_of(batch: Batch) -> int:
    """Tokens of a padded row: prompt and response columns."""
    return batch["prompts"].shape[1] + batch["responses"].shape[1]


def pass_sizes(part: Batch) -> str:
    rows, width = len(part), width_of(part)
    return f"a pass of {rows} responses x {width} tokens ({rows * width:,} tokens)"


def pass_fix(part: Batch, size: int | None) -> str:
    """What to change when a pass of ``part`` runs out of memory (``size``: the micro-batch size set)."""
    rows, width = len(part), width_of(part)
    if size:
        return (
            f"Lower trainer.micro_batch_size (try {max(1, size // 2)}) or set sharding.activation_checkpointing: true."
        )
    return (
        f"Set trainer.micro_batch_tokens (try {max(width, rows * width // 2):,}) or "
        "sharding.activation_checkpointing: true."
    )


@contextlib.contextmanager
def memory_errors(what: str, device: torch.device, sizes: str, fix: str) -> Iterator[None]:
    """Re-raise an out-of-memory error inside as :class:`OutOfMemory` naming what ran out of
    memory, the device, the sizes and the fix."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        first = str(e).split(". ")[0] if str(e) else "out of memory"
        raise OutOfMemory(f"out of memory in {what} on {describe(device)}: {sizes}. {fix} ({first}.)") from e
