#!/usr/bin/env python3
"""Training step of sharding strategy ``single`` (1 GPU) against ``fsdp`` (2 GPUs, torchrun).

A Qwen2.5-0.5B-shaped model (Qwen2ForCausalLM: 24 layers, hidden 896, vocabulary 151,936,
tied embeddings; random weights built from its config, nothing downloaded) trains on the
same global batch of random token sequences in every configuration: the trainer's own update of a
run of that strategy (``Trainer.train_on`` with given advantages: GRPO's loss over the response
half, passes of ``--micro-batch`` sequences through the run's pass runner, gradient clipping
through the strategy, an AdamW step). No generation (the run's engine, ``bench_replay`` of
common.py, loads no model). For each configuration it measures, per GPU:

- peak memory (``torch.cuda.max_memory_allocated`` and ``..._reserved``) over the timed steps;
- step time (median over the timed steps) and training tokens/s (prompt + response tokens
  of the global batch per second, as ``throughput/train_tokens_per_s`` counts them);
- the rollout-sync gather: seconds to stream all full tensors (``strategy.full_tensors``)
  and the memory it adds.

It prints a table and writes JSON (``--out``; default ``$OUT/gpu_fsdp.json`` when ``OUT`` is
set, else ``./gpu_fsdp.json``). Configurations run one after another in fresh processes
(the fsdp ones under ``python -m torch.distributed.run --nproc-per-node 2``); a failing one
is recorded with its error and the others still run.

Runs from a source checkout with torch and transformers (it puts ``core/`` and the grpo plugin on
``sys.path``) and needs, beyond them, what hybridrl's run needs: pluggy, pydantic (the wheels
pydantic, pydantic-core, annotated-types, typing-inspection) and pyyaml.

    python benchmarks/gpu_fsdp.py                    # 2 GPUs: 16 sequences x 1024 tokens, 3 + 6 steps
    python benchmarks/gpu_fsdp.py --only fsdp-bf16   # one configuration
    python benchmarks/gpu_fsdp.py --smoke            # CPU check of the script itself (gloo, tiny model)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

for key, value in {
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "NCCL_NVLS_ENABLE": "0",  # no NVLink multicast
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
}.items():
    os.environ.setdefault(key, value)

sys.path.insert(0, str(common.ROOT / "core"))

QWEN05 = dict(common.QWEN05, rope_theta=1000000.0)
TINY = dict(common.TINY, vocab_size=512, hidden_size=64, intermediate_size=128, rope_theta=1000000.0)

# name -> (processes, strategy, model dtype, fsdp options)
CONFIGS = {
    "single-fp32": (1, "single", "float32", {}),
    "single-bf16": (1, "single", "bfloat16", {}),
    "fsdp-fp32": (2, "fsdp", "float32", {}),
    "fsdp-bf16": (2, "fsdp", "float32", {"mixed_precision": "bf16"}),
    "fsdp-bf16-ac": (2, "fsdp", "float32", {"mixed_precision": "bf16", "activation_checkpointing": True}),
    "fsdp-bf16-grad-op": (2, "fsdp", "float32", {"mixed_precision": "bf16", "mode": "shard_grad_op"}),
    "fsdp-bf16-offload": (2, "fsdp", "float32", {"mixed_precision": "bf16", "offload": True}),
}
SMOKE_SKIP = {"fsdp-bf16-offload"}  # offload needs a GPU


# -- one configuration, in each of its processes ----------------------------------------------


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from hybridrl.config import load_config
    from hybridrl.run import build_run
    from hybridrl.trainer import Trainer

    common.use_checkout("algo_grpo")
    common.register_bench_plugin()
    _, strategy_name, dtype_name, options = CONFIGS[args.worker]
    B, L, micro = args.batch, args.seq_len, args.micro_batch
    T = L // 2  # the response half, as in an RL batch
    cfg = {
        "model": {"path": args.model, "dtype": dtype_name},
        "data": {"source": "bench_sums", "size": 64, "chat_template": False},
        "rollout": {"engine": "bench_replay", "sync_check": 0, "n": 1, "max_tokens": T},  # no rollouts: train_on
        "rewards": [{"function": "random_scores"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.0},
        "sharding": {"strategy": strategy_name, **options},
        "trainer": {"device": "cpu" if args.smoke else "cuda", "prompts_per_step": B, "micro_batch_size": micro,
                    "pack_sequences": False, "lr": 1e-6, "seed": 0, "sample_every": 0, "run_dir": args.run_dir},
        "logging": {"loggers": []},
    }  # fmt: skip
    trainer = Trainer(build_run(load_config(data=cfg), name="bench-fsdp"))
    run = trainer.run
    device, rank, world = run.ctx.device, run.ctx.rank, run.ctx.world_size
    cuda = device.type == "cuda"
    if B % world:
        raise SystemExit(f"--batch {B} does not divide by {world} processes")
    batch, advantages = rank_batch(run, B, L, T)
    rows = len(batch)

    def barrier() -> None:
        if dist.is_initialized():
            dist.barrier()

    def sync() -> tuple[float, float]:
        """Seconds to stream every full tensor, and the memory that adds (bytes)."""
        if cuda:
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        n = 0
        for _, t in run.strategy.full_tensors(run.policy):
            n += t.numel()
        if cuda:
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        extra = torch.cuda.max_memory_allocated(device) - base if cuda else 0
        return seconds, extra

    times = []
    for i in range(args.warmup + args.steps):
        if i == args.warmup and cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        if cuda:
            torch.cuda.synchronize(device)
        barrier()
        start = time.perf_counter()
        trainer.train_on(batch.select(list(range(rows))), i + 1, advantages=advantages)
        if cuda:
            torch.cuda.synchronize(device)
        barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    reserved = torch.cuda.max_memory_reserved(device) if cuda else None
    sync_s, sync_extra = sync()
    mine = {
        "rank": rank,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "peak_allocated_gib": peak / 2**30 if peak is not None else None,
        "peak_reserved_gib": reserved / 2**30 if reserved is not None else None,
        "step_times_s": times,
        "sync_s": sync_s,
        "sync_extra_gib": sync_extra / 2**30,
    }
    ranks = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(ranks, mine)
    else:
        ranks = [mine]
    if rank == 0:
        step = statistics.median(max(r["step_times_s"][i] for r in ranks) for i in range(len(times)))
        tokens = B * L  # the global batch: prompt + response tokens
        result = {
            "config": args.worker,
            "gpus": world,
            "strategy": strategy_name,
            "model_dtype": dtype_name,
            "options": options,
            "batch": B,
            "seq_len": L,
            "micro_batch_per_gpu": micro,
            "step_s": step,
            "train_tokens_per_s": tokens / step,
            "peak_allocated_gib_per_gpu": [r["peak_allocated_gib"] for r in ranks],
            "peak_reserved_gib_per_gpu": [r["peak_reserved_gib"] for r in ranks],
            "sync_s": max(r["sync_s"] for r in ranks),
            "sync_extra_gib": max(r["sync_extra_gib"] for r in ranks),
            "devices": [r["device"] for r in ranks],
        }
        Path(args.result).write_text(json.dumps(result))
    trainer.close(finished=True)  # every rank leaves the process group together


def rank_batch(run, B: int, L: int, T: int):
    """This rank's share of the global batch of ``B`` random sequences of ``L`` tokens, the last ``T``
    the response (a scored batch on the run's device), and random advantages for it."""
    import torch

    from hybridrl.batch import Batch
    from hybridrl.components import RolloutOutput

    rank, world = run.ctx.rank, run.ctx.world_size
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, run.model_config.vocab_size, (B, L), generator=gen)
    ids = ids[rank * B // world : (rank + 1) * B // world]
    rows = len(ids)
    out = RolloutOutput(ids[:, L - T :].tolist(), [[0.0] * T] * rows, ["length"] * rows)
    batch = Batch.from_rollout(ids[:, : L - T].tolist(), out, 1, run.tokenizer.pad_token_id)
    batch["scores"] = torch.zeros(rows)
    return batch.to(run.ctx.device), torch.randn(rows, T, generator=gen)  # the caller's advantages


# -- the driver ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(name: str, args, workdir: Path, model: str) -> dict:
    procs = CONFIGS[name][0]
    result = workdir / f"{name}.json"
    forward = ["--worker", name, "--result", str(result), "--batch", str(args.batch), "--seq-len", str(args.seq_len)]
    forward += ["--model", model, "--run-dir", str(workdir / f"run-{name}")]
    forward += ["--micro-batch", str(args.micro_batch), "--warmup", str(args.warmup), "--steps", str(args.steps)]
    forward += ["--smoke"] if args.smoke else []
    env = dict(os.environ)
    if procs == 1:
        cmd = [sys.executable, __file__, *forward]
        if not args.smoke:
            env.setdefault("CUDA_VISIBLE_DEVICES", "0")  # the single-GPU baseline sees one GPU
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(procs)]
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), __file__, *forward]
        if args.smoke:
            env |= {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0 or not result.is_file():
        return {"config": name, "error": (proc.stderr or proc.stdout)[-3000:], "wall_s": time.perf_counter() - start}
    return json.loads(result.read_text()) | {"wall_s": time.perf_counter() - start}


def fmt(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def table(results: list[dict]) -> str:
    cols = ["config", "GPUs", "step s", "train tokens/s", "peak alloc GiB per GPU", "peak reserved GiB"]
    cols += ["sync s", "sync +GiB"]
    head = "| " + " | ".join(cols) + " |"
    lines = [head, "|" + " --- |" * 8]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['config']} | failed: {r['error'].strip().splitlines()[-1][:80]} |")
            continue
        alloc = " / ".join(fmt(x) for x in r["peak_allocated_gib_per_gpu"])
        reserved = " / ".join(fmt(x) for x in r["peak_reserved_gib_per_gpu"])
        lines.append(
            f"| {r['config']} | {r['gpus']} | {r['step_s']:.3f} | {r['train_tokens_per_s']:,.0f} | {alloc} | "
            f"{reserved} | {r['sync_s']:.3f} | {r['sync_extra_gib']:.2f} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", choices=sorted(CONFIGS), help="Configurations to run (default: all).")
    p.add_argument("--batch", type=int, default=16, help="Sequences in the global batch.")
    p.add_argument("--seq-len", type=int, default=1024, help="Tokens per sequence (half of them the response).")
    p.add_argument("--micro-batch", type=int, default=4, help="Sequences per forward/backward on each GPU.")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--timeout", type=int, default=900, help="Seconds one configuration may take.")
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="Tiny model on the CPU with gloo: checks the script.")
    p.add_argument("--worker", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)  # the model folder the driver built
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    missing = [m for m in ("pydantic", "pluggy", "yaml") if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(
            f"missing {', '.join(missing)}: install the wheels pydantic, pydantic-core, annotated-types, "
            "typing-inspection, pluggy and pyyaml (pip install --no-index --find-links WHEEL_DIR ...)."
        )
    if args.worker:
        worker(args)
        return 0
    if args.smoke:
        args.batch, args.seq_len, args.micro_batch, args.warmup, args.steps = 4, 32, 2, 1, 2

    import torch
    import transformers

    names = args.only or [n for n in CONFIGS if not (args.smoke and n in SMOKE_SKIP)]
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "gpu_fsdp.json")
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "model": "Qwen2.5-0.5B-shaped Qwen2ForCausalLM, random weights" if not args.smoke else "tiny Qwen2 (smoke)",
        "batch": args.batch,
        "seq_len": args.seq_len,
        "micro_batch_per_gpu": args.micro_batch,
        "warmup": args.warmup,
        "steps": args.steps,
    }
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = common.build_model(Path(tmp) / "model", TINY if args.smoke else QWEN05, "float32")
        for name in names:
            try:
                results.append(run_config(name, args, Path(tmp), model))
            except Exception:
                results.append({"config": name, "error": traceback.format_exc()})
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))  # partial results survive
            print(table(results[-1:]).splitlines()[-1], flush=True)
    print(f"\n{meta['model']}; global batch {args.batch} x {args.seq_len} tokens; torch {meta['torch']}")
    print(table(results))
    print(f"\nwrote {out}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
