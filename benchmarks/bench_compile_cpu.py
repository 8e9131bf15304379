#!/usr/bin/env python3
"""Compiling on the CPU, first run and second run, against the eager defaults: the demo's GRPO run
(SmolLM2-135M, the chain-sum task, ``hf`` engine) through the CLI, as a user runs it.

    python benchmarks/bench_compile_cpu.py                 # 3 steps a side
    python benchmarks/bench_compile_cpu.py --steps 5 --out /tmp/compile_cpu.json

Sides, one after the other on this machine (``--sides``, the first the baseline): ``eager`` (the
defaults: on a CPU nothing compiles), ``compiled-cold`` (``sharding.compile: on``,
``rollout.compile: on``, an empty compile cache) and ``compiled-warm`` (the same again, finding what
the first compiled in ``trainer.compile_cache``); for a first run's decoding, ``static-eager`` (the
engine's own loop, eager), ``decoding-cold`` (its step compiled at the first call) and
``background-cold`` (``rollout.compile: background``: compiled in a thread while calls decode eagerly).
Reported per side: torch.compile's seconds at step 1 (``timing/compile``: tracing, compiling, and
loading from the cache), step 1, the median of the later steps, the wall-clock of the command, and
each step's mean reward (the same samples whichever path ran them). Prints a table and writes JSON
(``--out``, default benchmarks/results/compile_cpu.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMPILED = ["sharding.compile=on", "rollout.compile=on"]
SIDES = {  # a side's compile cache is its first word's: compiled-warm finds what compiled-cold compiled
    "eager": [],
    "compiled-cold": COMPILED,
    "compiled-warm": COMPILED,
    "static-eager": ["rollout.cache=static"],  # the engine's own loop, eager: what the first calls below run
    "decoding-cold": ["rollout.compile=on"],  # the decoding step compiled at the first call, waited for
    "background-cold": ["rollout.compile=background"],  # compiled in a thread, eager calls meanwhile
}


def run_side(args, name: str, overrides: list[str], cache: Path, workdir: Path) -> dict:
    run_dir = workdir / name
    command = [str(Path(sys.executable).with_name("hybridrl")), "train", str(ROOT / args.config)]
    command += [f"trainer.steps={args.steps}", f"trainer.compile_cache={cache}", f"trainer.run_dir={run_dir}"]
    command += ["trainer.eval_before_train=false", "trainer.eval_after_train=false", *overrides]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing/step" in r]
    later = [r["timing/step"] for r in rows[1:]]
    return {
        "side": name,
        "overrides": overrides,
        "compile_s_step1": rows[0].get("timing/compile", 0.0),
        "step1_s": rows[0]["timing/step"],
        "later_step_s_median": statistics.median(later) if later else None,
        "wall_s": wall,
        "rewards": [r["reward/mean"] for r in rows],
        "eager_calls": [r.get("hf/eager_calls") for r in rows],  # background: the calls before it was ready
        "recompile_limit_hit": "recompile_limit" in done.stderr,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="examples/grpo_smollm2_chain_sum.yaml")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compile_cpu.json"))
    parser.add_argument("--sides", default="eager,compiled-cold,compiled-warm",
                        help=f"comma-separated, the first the baseline; of {', '.join(SIDES)}")  # fmt: skip
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hybridrl-compile-bench-") as tmp:
        workdir = Path(tmp)
        sides = [run_side(args, name, SIDES[name], workdir / f"cache-{name.split('-')[0]}", workdir)
                 for name in args.sides.split(",")]  # fmt: skip
    eager = sides[0]
    ratio = "wall/" + eager["side"]
    print(f"\n{'side':<16} {'compile@1':>10} {'step 1':>8} {'later':>8} {'wall':>8} {ratio:>14}  rewards")
    for s in sides:
        later = f"{s['later_step_s_median']:.2f}" if s["later_step_s_median"] is not None else "-"
        rewards = ", ".join(f"{r:.3f}" for r in s["rewards"])
        print(f"{s['side']:<16} {s['compile_s_step1']:>10.1f} {s['step1_s']:>8.1f} {later:>8} {s['wall_s']:>8.1f} "
              f"{s['wall_s'] / eager['wall_s']:>14.2f}  {rewards}")  # fmt: skip
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "config": args.config,
        "steps": args.steps,
        "sides": sides,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
