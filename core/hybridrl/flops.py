"""Model FLOPs of a forward pass, and accelerator peaks, for the MFU metrics.

Counted as matrix multiplications only (2 FLOPs per multiply-add): every weight matrix of the
transformer body once per token, the output layer once per token whose logits are computed,
and causal attention (scores and weighted sum) over each sequence's own length. A training
pass (forward + backward) is 3x the forward; recomputation for activation checkpointing is
not counted, as in the usual MFU definition (PaLM, Megatron-LM).
"""

from __future__ import annotations

import torch

# Dense (no sparsity) bfloat16 tensor-core peaks from NVIDIA's data sheets, in FLOP/s. The
# first name found in torch.cuda.get_device_name() wins, so more specific names come first.
PEAK_BF16 = [
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H800", 989e12),
    ("H20", 148e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("L4", 121e12),
]


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak in FLOP/s, or None when it is not a GPU in :data:`PEAK_BF16`."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16 if key in name), None)


def forward_flops(
    model: torch.nn.Module, seq_lens: list[int], logit_tokens: int, shared_prompts: list[tuple[int, int]] = ()
) -> float:
    """FLOPs of one forward pass over sequences of ``seq_lens`` tokens, of which
    ``logit_tokens`` positions go through the output layer. ``shared_prompts``: (length, rows) of
    each prompt that ``rows`` of the sequences begin with and that ran once for all of them
    (``trainer.share_prompts``): its tokens and its own attention count once."""
    cfg = model.config
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    skip = {id(p) for m in (embed, head) if m is not None for p in m.parameters()}
    body = sum(p.numel() for p in model.parameters() if id(p) not in skip and p.dim() >= 2)
    head_params = head.weight.numel() if head is not None else 0
    heads = cfg.num_attention_heads
    attn_dim = heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    tokens = sum(seq_lens) - sum(p * (rows - 1) for p, rows in shared_prompts)
    # causal: half the square, x2 matmuls x2; a shared prompt's own square once (its rows' responses
    # still attend to it: (P + R)^2 = P^2 + 2PR + R^2)
    squares = sum(s * s for s in seq_lens) - sum(p * p * (rows - 1) for p, rows in shared_prompts)
    attention = 2 * cfg.num_hidden_layers * attn_dim * squares
    return 2.0 * body * tokens + 2.0 * head_params * logit_tokens + attention
