#!/usr/bin/env python3
"""The GPU's measured peaks, and the floors its matrix multiplications put under a GRPO step.

    python benchmarks/gpu_floors.py                  # the 0.5B shape of the reference configuration
    python benchmarks/gpu_floors.py --shape 3b
    python benchmarks/gpu_floors.py --smoke          # CPU check of the script (tiny shape)

Measured on this device in bfloat16, each figure the median of ``--repeats`` timings:

- **peaks**: a dense 8192 x 8192 x 8192 matrix multiplication (TFLOP/s) and a device-to-device copy
  of 2 GiB (TB/s, bytes read plus written);
- **the update**: every matrix multiplication of one training pass over ``--tokens`` tokens
  (64 x (128 + 256) in the reference configuration), each linear layer's shape forward and
  backward through autograd as a pass runs it, the output layer over the response tokens only,
  causal attention through SDPA, and a fused AdamW step over the shape's parameters in float32.
  Their sum is the update's floor with these kernels; the FLOPs hybridrl counts for MFU
  (``common.matmul_flops``) over that floor, against the data sheet's peak (the one the trainer's
  MFU is counted against, read from one step of a tiny run), is the highest MFU they allow. Then
  the same with the bytes the work between them must move at the least (SiLU, norms, residual adds,
  rotary embedding, the weights' casts, the output layer's softmax: :func:`pointwise_bytes`) at
  the measured bandwidth;
- **decoding**: one token for ``--rows`` rows through every layer as the ``hf`` engine runs it
  (fused q/k/v and gate/up projections, attention over a cache of prompt + response columns,
  each layer its own weights so that nothing stays in L2), and the output layer, captured in one
  CUDA graph and replayed: the milliseconds a token needs with no host, no idle time and no other
  kernel, against the weights' bytes at the measured bandwidth.

Prints a table and writes JSON (``--out``, default ``$OUT/floors_gpu.json``).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SHAPES = {"0.5b": common.QWEN05, "3b": common.QWEN3B, "tiny": common.TINY}


def timer(fn, repeats: int, device) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up (CUDA events on a GPU)."""
    import torch

    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peaks(device, repeats: int, smoke: bool) -> dict:
    import torch

    n = 512 if smoke else 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    gemm = timer(lambda: a @ b, repeats, device)
    src = torch.empty((2**24 if smoke else 2**30), dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    copy = timer(lambda: dst.copy_(src), repeats, device)
    moved = 2 * src.numel() * src.element_size()
    return {"gemm_tflops": 2 * n**3 / gemm / 1e12, "copy_tb_s": moved / copy / 1e12}


def linears(shape: dict) -> dict[str, tuple[int, int, int]]:
    """name: (in features, out features, count per layer) of a block's linear layers."""
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = h // heads
    return {
        "q": (h, heads * d, 1),
        "k/v": (h, kv * d, 2),
        "o": (heads * d, h, 1),
        "gate/up": (h, inter, 2),
        "down": (inter, h, 1),
    }


def pass_seconds(x_rows: int, fan_in: int, fan_out: int, device, repeats: int) -> tuple[float, float]:
    """Forward and backward seconds of one bf16 linear layer (with bias-free weights) over ``x_rows``."""
    import torch

    w = torch.randn(fan_out, fan_in, device=device, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(x_rows, fan_in, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(x_rows, fan_out, device=device, dtype=torch.bfloat16)
    forward = timer(lambda: torch.nn.functional.linear(x, w), repeats, device)
    y = torch.nn.functional.linear(x, w)
    backward = timer(lambda: torch.autograd.grad(y, (x, w), grad, retain_graph=True), repeats, device)
    return forward, backward


def meta_model(shape: dict):
    """The shape's Qwen2ForCausalLM on the meta device: its parameters counted, no memory taken."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        return Qwen2ForCausalLM(Qwen2Config(**shape))


def pointwise_bytes(shape: dict, tokens: int, response_tokens: int, params: int) -> dict[str, int]:
    """The fewest bytes the update's work between its matrix multiplications moves, each tensor read or
    written once a pass (bfloat16 activations, float32 weights): what no kernel can avoid that leaves
    the matrix multiplications to cuBLAS, whose outputs go to memory."""
    h, i, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    return {
        # SiLU(gate) x up: forward reads gate and up, writes the product; backward reads its gradient,
        # gate and up, writes their gradients
        "SiLU x up": 2 * tokens * i * (3 + 5) * layers,
        # two RMSNorms a block, each fused with the residual add before it: forward reads the stream
        # and the branch, writes the sum and the normed; backward reads the gradient, the sum and the
        # skip's gradient, writes the stream's
        "norms and residual adds": 2 * tokens * h * (4 + 4) * 2 * layers,
        # the rotary embedding of queries and keys: read and written, forward and backward
        "rotary embedding": 2 * tokens * (h + kv) * 2 * 2 * layers,
        # the float32 weights cast to bfloat16 for the forward; the bfloat16 gradients cast to float32
        "weight casts": params * (4 + 2 + 2 + 4),
        # the output layer's log-softmax: the logits read forward, read and their gradient written backward
        "output layer softmax": 2 * response_tokens * shape["vocab_size"] * 3,
    }


def update_floor(shape: dict, args, device, peak: float | None, bandwidth_tb_s: float) -> dict:
    import torch

    layers, rows = shape["num_hidden_layers"], {}
    for name, (fan_in, fan_out, count) in linears(shape).items():
        f, b = pass_seconds(args.tokens, fan_in, fan_out, device, args.repeats)
        rows[name] = {"forward_s": f * count * layers, "backward_s": b * count * layers}
    f, b = pass_seconds(args.response_tokens, shape["hidden_size"], shape["vocab_size"], device, args.repeats)
    rows["output layer"] = {"forward_s": f, "backward_s": b}
    heads, d = shape["num_attention_heads"], shape["hidden_size"] // shape["num_attention_heads"]
    seqs, length = args.sequences, args.tokens // args.sequences
    # every query head with keys and values of its own: SDPA's flash kernel whatever the GQA support
    q, k, v = (
        torch.randn(seqs, heads, length, d, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in "qkv"
    )
    sdpa = torch.nn.functional.scaled_dot_product_attention
    f = timer(lambda: sdpa(q, k, v, is_causal=True), args.repeats, device)
    out = sdpa(q, k, v, is_causal=True)
    b = timer(
        lambda: torch.autograd.grad(out, (q, k, v), torch.ones_like(out), retain_graph=True), args.repeats, device
    )
    rows["attention"] = {"forward_s": f * layers, "backward_s": b * layers}
    model = meta_model(shape)
    params = sum(p.numel() for p in model.parameters())
    p = torch.zeros(params, device=device, requires_grad=True)
    p.grad = torch.randn_like(p)
    adam = torch.optim.AdamW([p], lr=1e-6, fused=device.type == "cuda")
    rows["AdamW (fp32)"] = {"forward_s": 0.0, "backward_s": timer(adam.step, args.repeats, device)}
    del p, adam
    total = sum(r["forward_s"] + r["backward_s"] for r in rows.values())
    flops = 3 * common.matmul_flops(model, [length] * seqs, args.response_tokens)  # as the trainer's MFU counts them
    moved = pointwise_bytes(shape, args.tokens, args.response_tokens, params)
    with_moves = total + sum(moved.values()) / (bandwidth_tb_s * 1e12)
    return {
        "rows": rows,
        "floor_s": total,
        "flops": flops,
        "mfu_ceiling": flops / total / peak if peak else None,
        "pointwise_bytes": moved,
        "floor_with_pointwise_s": with_moves,
        "mfu_ceiling_with_pointwise": flops / with_moves / peak if peak else None,
    }


def decode_floor(shape: dict, args, device, bandwidth_tb_s: float | None) -> dict:
    """One token of ``args.rows`` rows through every layer's projections and attention, then the output layer."""
    import torch

    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    d, cache = h // heads, args.cache_columns
    bf16 = dict(device=device, dtype=torch.bfloat16)
    weights = [
        (torch.randn(h + 2 * kv * d, h, **bf16) * 0.02, torch.randn(h, h, **bf16) * 0.02,
         torch.randn(2 * inter, h, **bf16) * 0.02, torch.randn(h, inter, **bf16) * 0.02)
        for _ in range(layers)
    ]  # fmt: skip
    keys = [torch.randn(args.rows, kv, cache, d, **bf16) for _ in range(layers)]
    head = torch.randn(shape["vocab_size"], h, **bf16) * 0.02
    x = torch.randn(args.rows, h, **bf16)

    def token(attention: bool):
        y = x
        for (qkv, o, gate_up, down), k in zip(weights, keys):
            a = y @ qkv.T
            if attention:  # the hf engine's grouped decode attention, keys standing in for values too
                q = a[:, :h].view(args.rows, kv, heads // kv, d)
                s = torch.softmax(torch.matmul(q, k.transpose(-1, -2)).float(), dim=-1).to(y.dtype)
                a = torch.matmul(s, k).reshape(args.rows, h)
            else:
                a = a[:, :h]
            y = a @ o.T
            g = y @ gate_up.T
            y = (torch.nn.functional.silu(g[:, :inter]) * g[:, inter:]) @ down.T if attention else g[:, :inter] @ down.T
        return y @ head.T

    result = {}
    for name, attention in (("projections", False), ("projections + attention", True)):
        if device.type == "cuda":
            token(attention)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                token(attention)
            result[name + "_ms"] = timer(graph.replay, args.repeats, device) * 1e3
        else:
            result[name + "_ms"] = timer(lambda a=attention: token(a), args.repeats, device) * 1e3
    weight_bytes = sum(t.numel() * 2 for layer in weights for t in layer) + head.numel() * 2
    result["weight_bytes"] = weight_bytes
    result["bandwidth_floor_ms"] = weight_bytes / (bandwidth_tb_s * 1e12) * 1e3 if bandwidth_tb_s else None
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="0.5b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=64 * 384, help="tokens of a training pass")
    p.add_argument("--response-tokens", type=int, default=64 * 256, help="of them, tokens through the output layer")
    p.add_argument("--sequences", type=int, default=64, help="sequences of equal length the tokens are cut into")
    p.add_argument("--rows", type=int, default=64, help="decoding rows")
    p.add_argument("--cache-columns", type=int, default=384, help="KV cache columns in decoding")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="CPU check: tiny shape and sizes")
    args = p.parse_args()
    if args.smoke:
        args.shape, args.tokens, args.response_tokens, args.sequences, args.rows, args.repeats = (
            "tiny",
            512,
            256,
            4,
            4,
            2,
        )
    common.use_checkout("algo_grpo")
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    with tempfile.TemporaryDirectory() as tmp:  # the peak the trainer's MFU counts against: from a step's metrics
        peak = common.trainer_peak_flops(Path(tmp)) if device.type == "cuda" else None
    shape = SHAPES[args.shape]
    result = {
        "machine": f"{platform.machine()}, {name}",
        "versions": {"torch": torch.__version__},
        "config": vars(args),
        "data_sheet_peak_tflops": peak and peak / 1e12,
    }
    result["peaks"] = peaks(device, args.repeats, args.smoke)
    result["update"] = update_floor(shape, args, device, peak, result["peaks"]["copy_tb_s"])
    result["decode"] = decode_floor(shape, args, device, result["peaks"]["copy_tb_s"])
    u, dec = result["update"], result["decode"]
    print(
        f"peaks: {result['peaks']['gemm_tflops']:.0f} TFLOP/s dense bf16, {result['peaks']['copy_tb_s']:.2f} TB/s copy"
    )
    print("update part | forward ms | backward ms")
    for part, r in u["rows"].items():
        print(f"{part} | {r['forward_s'] * 1e3:.2f} | {r['backward_s'] * 1e3:.2f}")
    ceiling = f", MFU at most {u['mfu_ceiling']:.1%}" if u["mfu_ceiling"] else ""
    print(f"update floor {u['floor_s'] * 1e3:.1f} ms for {u['flops'] / 1e12:.1f} TFLOP{ceiling}")
    moved = sum(u["pointwise_bytes"].values()) / 1e9
    ceiling = f", MFU at most {u['mfu_ceiling_with_pointwise']:.1%}" if u["mfu_ceiling_with_pointwise"] else ""
    print(f"with the {moved:.1f} GB the work between them moves: {u['floor_with_pointwise_s'] * 1e3:.1f} ms{ceiling}")
    print(
        f"decoding a token ({args.rows} rows): projections {dec['projections_ms']:.3f} ms, with attention "
        f"{dec['projections + attention_ms']:.3f} ms; the weights at the copy bandwidth "
        f"{dec['bandwidth_floor_ms'] or 0:.3f} ms"
    )
    path = common.out_path(args.out, "floors_gpu.json")
    common.write_json(result, path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
