#!/usr/bin/env python3
"""hybridrl against TRL at its best settings as the batch, the responses and the model grow.

    python benchmarks/gpu_scaling.py                       # every row, one after the other
    python benchmarks/gpu_scaling.py --rows ref,c512       # some rows
    python benchmarks/gpu_scaling.py --smoke               # CPU check of the script

Each row is one run of ``gpu_vs_trl.py`` (each side in its own process on the same GPU, one
after the other), so every ratio compares sides measured minutes apart on one machine. Rows:

    ref       8 prompts x 8 samples, 256 tokens, fixed lengths, the 0.5B shape
    ref-long  the same with long-tail lengths (and the vllm plugin against the bare engine)
    c512      64 x 8 = 512 completions of 256 tokens
    c512-long the same with long-tail lengths (and the vllm plugin against the bare engine)
    c2048     256 x 8 = 2048 completions of 256 tokens
    t1024     8 x 8 completions of up to 1024 tokens, long-tail lengths
    t4096     8 x 8 completions of up to 4096 tokens, long-tail lengths
    3b        8 x 8 x 256, fixed lengths, the 3B shape
    3b-c512   64 x 8 = 512 completions of 256 tokens, the 3B shape

TRL's side: colocated vLLM, gradient checkpointing off (faster than its default, on), and where
a step's completions do not fit one pass, gradient accumulation over micro-batches of 64 (8 for
the 3B shape), the largest that fit in earlier runs, and of 16 at 1024 tokens and 4 at 4096
(64 x 1024 ran out of memory; larger ones were not tried); hybridrl's side: its defaults with
``compile``, and for the vllm plugin ``seed_requests: false`` (its faster setting: vLLM samples
seeded requests one by one). Prints the table and writes JSON (``--out``, default ``$OUT/scaling_gpu.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_vs_trl  # noqa: E402


def trl(micro: int, completions: int) -> str:
    options = {"gradient_checkpointing": False}
    if completions > micro:
        options |= {"per_device_train_batch_size": micro, "gradient_accumulation_steps": completions // micro}
    return json.dumps(options)


ROWS = {
    "ref": dict(prompts=8, max_tokens=256),
    "ref-long": dict(prompts=8, max_tokens=256, lengths="long-tail", sides="hybridrl-hf,hybridrl-vllm,trl-vllm"),
    "c512": dict(prompts=64, max_tokens=256),
    "c512-long": dict(prompts=64, max_tokens=256, lengths="long-tail", sides="hybridrl-hf,hybridrl-vllm,trl-vllm"),
    "c2048": dict(prompts=256, max_tokens=256),
    "t1024": dict(prompts=8, max_tokens=1024, lengths="long-tail", micro=16),
    "t4096": dict(prompts=8, max_tokens=4096, lengths="long-tail", micro=4),
    "3b": dict(prompts=8, max_tokens=256, shape="3b", micro=8),
    "3b-c512": dict(prompts=64, max_tokens=256, shape="3b", micro=8),
}


def row_args(name: str, args) -> list[str]:
    row = ROWS[name]
    completions = row["prompts"] * 8
    argv = ["--prompts", str(row["prompts"]), "--n", "8", "--max-tokens", str(row["max_tokens"])]
    argv += ["--sides", row.get("sides", "hybridrl-hf,trl-vllm"), "--lengths", row.get("lengths", "fixed")]
    argv += ["--shape", row.get("shape", "0.5b"), "--trl-options", trl(row.get("micro", 64), completions)]
    argv += ["--sharding", json.dumps({"compile": True}), "--warmup", str(args.warmup), "--steps", str(args.steps)]
    argv += ["--vllm-options", json.dumps({"seed_requests": False})]
    argv += ["--out", str(Path(args.out).with_suffix("") / f"{name}.json"), "--side-timeout", str(args.side_timeout)]
    if row.get("lengths") == "long-tail":
        argv += ["--bare"]
    if args.smoke:
        argv += ["--smoke"]
    return argv


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, from {', '.join(ROWS)}")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--side-timeout", type=float, default=420)
    p.add_argument("--out", default=str(Path(os.environ.get("OUT", ".")) / "scaling_gpu.json"))
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    table = {}
    for name in args.rows.split(","):
        if name not in ROWS:
            raise SystemExit(f"unknown row '{name}'; choose from {', '.join(ROWS)}")
        print(f"\n== row {name}", flush=True)
        argv = row_args(name, args)
        gpu_vs_trl.main(gpu_vs_trl.parse_args(argv))
        result = json.loads(Path(argv[argv.index("--out") + 1]).read_text())
        table[name] = {"summary": result.get("summary", {}), "ratios": result.get("ratios", {}), "args": argv}
        Path(args.out).write_text(json.dumps(table, indent=1) + "\n")
    print(f"\n{'row':<9} {'side':<14} {'step s':>8} {'tok/s':>10} {'length':>7} {'MFU':>6} {'TRL / hybridrl':>15}")
    for name, row in table.items():
        ratio = row["ratios"].get("best_trl_over_best_hybridrl")
        for side, s in row["summary"].items():
            mfu = f"{s['update_mfu']:.1%}" if s.get("update_mfu") else ""
            tok = s.get("generated_tokens_per_s_whole_step") or 0
            length = s.get("response_length_mean") or 0
            print(f"{name:<9} {side:<14} {s['step_s']:>8.3f} {tok:>10,.0f} {length:>7.1f} {mfu:>6}", end="")
            print(f" {f'{ratio:.2f}x' if ratio and side.startswith('trl') else '':>15}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
