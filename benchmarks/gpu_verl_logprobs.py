#!/usr/bin/env python3
"""Where verl 0.9.1's training passes spend their time without flash-attn: its log-prob fallback.

    python benchmarks/gpu_verl_logprobs.py [--rows 64] [--width 384] [--out FILE]
    python benchmarks/gpu_verl_logprobs.py --smoke      # CPU check of the script (tiny sizes)

verl computes log-probs with flash-attn's cross-entropy kernel when it can import it; without it
(``verl/utils/torch_functional.py``: ``logprobs_from_logits`` -> ``logprobs_from_logits_v2``) a
bf16 pass takes ``log_softmax`` and ``gather`` one row of the flattened logits at a time, in a
Python loop, over every position of the padded batch (prompts included), and the update's
backward walks the same rows. This script times that loop against one ``log_softmax`` over all
rows, on the reference model of gpu_vs_verl.py (Qwen2.5-0.5B-shaped, random float32 weights,
bf16 autocast, sdpa, 64 x 384 tokens: one verl pass of the reference configuration), with
verl's own function when verl is importable and an equivalent loop otherwise; beside it the
other work verl's passes add (the entropy over all logits in the old-log-prob pass, the copy of
the logits, the float32 reference weights copied from the CPU each pass). Medians of a few runs
after one warm-up. Prints a table and writes JSON (``--out``; default ``$OUT/verl_logprobs.json``).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def per_row(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """verl's fallback, where verl is not importable: a row at a time."""
    return torch.stack([F.log_softmax(r, -1).gather(-1, t[None]).squeeze(-1) for r, t in zip(logits, labels)])


def one_pass(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(logits.float(), -1).gather(-1, labels[:, None]).squeeze(-1)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)


def timed(fn, device, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first warms up
        common.wait_for_gpu()
        start = time.perf_counter()
        fn()
        common.wait_for_gpu()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


@torch.no_grad()
def no_grad_rows(logits, loop, labels, bf16, device, repeats: int) -> dict[str, float]:
    """The forward pass's parts without gradients (verl's old-log-prob and reference passes)."""
    rows = {"forward, logits of every position": timed(logits, device, repeats)}
    full = logits()
    flat = torch.cat(list(full.unbind(0)))
    with bf16:
        rows["verl's per-row log-probs, no grad"] = timed(lambda: loop(flat, labels), device, repeats)
        rows["one log_softmax + gather, no grad"] = timed(lambda: one_pass(flat, labels), device, repeats)
        rows["entropy over every position"] = timed(lambda: entropy(full), device, repeats)
    rows["copy of the logits (unbind + cat)"] = timed(lambda: torch.cat(list(full.unbind(0))), device, repeats)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    device = torch.device("cpu" if args.smoke else "cuda")
    shape = dict(common.QWEN05)
    if args.smoke:
        shape |= dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=4096)  # fmt: skip
        args.rows, args.width, args.repeats = 4, 32, 1
    try:
        from verl.utils.torch_functional import logprobs_from_logits_v2 as loop

        source = "verl.utils.torch_functional.logprobs_from_logits_v2"
    except ImportError:
        loop, source = per_row, "an equivalent loop (verl not importable)"
    with device:
        model = Qwen2ForCausalLM(Qwen2Config(**shape, attn_implementation="sdpa"))
    ids = torch.randint(0, shape["vocab_size"], (args.rows, args.width), device=device)
    labels = torch.roll(ids.flatten(), -1)
    bf16 = torch.autocast(device.type, dtype=torch.bfloat16)

    def logits():
        with bf16:
            return model(input_ids=ids, use_cache=False).logits

    def update(logprobs):
        with bf16:
            out = logprobs(torch.cat(list(logits().unbind(0))), labels)
        out.float().mean().backward()
        model.zero_grad(set_to_none=True)

    rows = no_grad_rows(logits, loop, labels, bf16, device, args.repeats)
    rows["update pass with verl's per-row log-probs"] = timed(lambda: update(loop), device, args.repeats)
    rows["update pass with one log_softmax"] = timed(lambda: update(one_pass), device, args.repeats)
    weights = torch.empty(sum(p.numel() for p in model.parameters()))  # the float32 reference on the CPU
    if device.type == "cuda":
        weights = weights.pin_memory()
    rows["float32 reference weights to the device"] = timed(lambda: weights.to(device), device, args.repeats)

    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine() + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""),
        "torch": torch.__version__,
        "config": vars(args) | {"loop": source, "tokens": args.rows * args.width},
        "seconds": rows,
        "ratios": {
            "no grad": rows["verl's per-row log-probs, no grad"] / rows["one log_softmax + gather, no grad"],
            "update": rows["update pass with verl's per-row log-probs"] / rows["update pass with one log_softmax"],
        },
    }
    print(f"{'what':48} {'s':>8}")
    for name, seconds in rows.items():
        print(f"{name:48} {seconds:8.3f}")
    print(", ".join(f"per-row / one pass, {k}: {v:.1f}x" for k, v in result["ratios"].items()))
    path = common.out_path(args.out, "verl_logprobs.json")
    common.write_json(result, path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
