#!/usr/bin/env python3
"""The built-in ``hf`` rollout engine on the reference configuration: its own decoding loop on
the static cache against transformers ``generate``, in speed, in the tokens they sample and in
how exactly their logprobs match the trainer's.

    python benchmarks/gpu_hf_engine.py               # on the GPU: 8 prompts x 8 samples x 256 tokens
    python benchmarks/gpu_hf_engine.py --smoke       # CPU check of the script (tiny model)

The engine is ``rollout.engine: hf`` with ``compile: on`` and ``cache: static``, on the
Qwen2.5-0.5B-shaped random model of common.py: prompts of 128 tokens, temperature 1, EOS
ignored (responses of exactly ``--max-tokens`` tokens), seed 0 for every call. On the static
cache the engine decodes with its own loop; ``generate`` is the same engine with ``cache: dynamic``
(its CPU default), which decodes through transformers ``generate``. Each path serves one block of
calls after the other: ``--warmup`` calls per path first (they compile), then ``--rounds``
rounds of ``--calls`` timed calls per path, the GPU synchronised around each. Reported per path:
the median seconds per rollout and tokens/s, its time over the decoding loop's (``time ratio``),
the fraction of tokens that are the same as the decoding loop's for the same seed, and the mean and max absolute
difference between the engine's logprobs and the trainer's (the pass runner of a run whose policy
is the model in float32, ``common.scoring_run``, on the same tokens). This runs for the bfloat16
engine (the default on CUDA) and for a float32 copy (``dtype: float32``), where the logprobs should
match the trainer's to float32 rounding. Writes ``$OUT/hf_engine.json`` (or ``--out``).

``--profile`` then profiles one call of the decoding loop (torch.profiler, CPU and CUDA): the
GPU's busy time against the call's wall time (a gap is time the GPU waits for the host), the
number of kernels per decoding step and the kernels that take the most GPU time. ``--shape 3b``
takes the Qwen2.5-3B shape instead; ``--paths decode`` skips transformers ``generate``, and
``--paths decode,decode:0,decode:1`` adds the loop with ``graph_tokens`` 0 (no CUDA graphs) and 1
(a CUDA graph a token) against its default (16), and ``decode:full`` the loop without
``compact_rows`` (every row decoded until the last one ends). ``--lengths long-tail`` lets
responses end at random (the model of ``gpu_vs_trl.py --lengths long-tail``: geometric lengths,
mean about max_tokens / 4) instead of ignoring EOS; tokens per second then count the tokens
returned, and ``decoded rows`` is the fraction of row-steps the loop computed
(``hf/decoded_row_fraction``).
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

PATHS = ("decode", "generate")  # the engine's own loop on the static cache; transformers generate
R: dict = {"errors": [], "engines": {}}
COLUMNS = [
    ("engine  ", "dtype", "{:<8}"),
    ("path    ", "path", "{:<8}"),
    ("warm-up s", "warmup_s", "{:>9.2f}"),
    ("s/rollout", "median_s", "{:>9.3f}"),
    ("tokens/s", "tokens_per_s", "{:>8,.0f}"),
    ("mean len", "mean_length", "{:>8.1f}"),
    ("time ratio", "over_decode", "{:>10.2f}"),
    ("same tokens", "same_token_fraction", "{:>11.3f}"),
    ("decoded rows", "decoded_row_fraction", "{:>12.3f}"),
    ("lp diff mean", "logprob_diff_mean", "{:>12.2e}"),
    ("lp diff max", "logprob_diff_max", "{:>11.2e}"),
]


@contextlib.contextmanager
def decoding_path(engines: dict, path: str):
    """The engine that decodes through ``path`` inside the block: 'decode' is what the compiled engine
    does on the static cache, 'decode:K' the same with ``graph_tokens`` K (0: no CUDA graphs) and
    'decode:full' without ``compact_rows`` (its settings changed for the block); 'generate' is the
    engine on the dynamic cache (``cache: dynamic``), which decodes through transformers ``generate``."""
    if path == "generate":
        yield engines["generate"]
        return
    engine = engines["decode"]
    default, compact = engine.graph_tokens, engine.options.compact_rows
    if path == "decode:full":
        engine.options.compact_rows = False
    elif path.startswith("decode:"):
        engine.graph_tokens = int(path.split(":")[1])
    try:
        yield engine
    finally:
        engine.graph_tokens, engine.options.compact_rows = default, compact


def timed_rollout(engine, prompts, sampling):
    common.wait_for_gpu()
    start = time.perf_counter()
    out = engine.generate(prompts, sampling)
    common.wait_for_gpu()
    return time.perf_counter() - start, out


def same_token_fraction(a, b) -> float:
    """The fraction of positions where two rollouts of the same prompts sampled the same token."""
    same = sum(x == y for ra, rb in zip(a.token_ids, b.token_ids) for x, y in zip(ra, rb))
    return same / max(1, sum(map(len, a.token_ids)))


def logprob_diff(run, prompts, out, n: int) -> tuple[float, float]:
    """Mean and max |engine logprob - trainer logprob| over the response tokens of ``out``: the
    trainer's pass (``run.passes``) of a float32 policy over the same tokens."""
    lp, batch = common.trainer_logprobs(run, prompts, out, n)
    mask = batch["response_mask"].bool()
    diff = (lp.float() - batch["rollout_logprobs"]).abs()[mask]
    return diff.mean().item(), diff.max().item()


def profile_decode(engine, prompts, sampling, rows: int = 20) -> dict:
    """One call of the engine's decoding loop under torch.profiler: wall time, GPU busy time,
    kernels per decoding step and the kernels with the most GPU time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    common.wait_for_gpu()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        seconds, _ = timed_rollout(engine, prompts, sampling)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels) / 1e6  # microseconds -> s (overlaps counted twice)
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.device_time / 1e3)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:rows]
    return {
        "wall_s": seconds,
        "gpu_busy_s": busy,
        "gpu_busy_fraction": busy / seconds,
        "kernels": len(kernels),
        "kernels_per_token": len(kernels) / sampling.max_tokens,
        "ms_per_token": 1e3 * seconds / sampling.max_tokens,
        "top_kernels": [
            {"name": name[:120], "calls": len(ms), "total_ms": sum(ms), "mean_us": 1e3 * sum(ms) / len(ms)}
            for name, ms in top
        ],
    }


def run_engine(args, ctx, dtype: str, run, prompts, sampling) -> dict:
    """Warm-up, then alternating timed blocks of every path; the rows of the table. The decoding
    paths share one engine (compiled, static cache), 'generate' has its own (dynamic cache)."""
    from hybridrl import plugins

    cls = plugins.lookup("rollout engine", "hf")
    paths = args.paths.split(",")
    engines = {"decode": cls(cls.Options(compile="on", cache="static", dtype=dtype), ctx)}
    if "generate" in paths:
        engines["generate"] = cls(cls.Options(cache="dynamic", dtype=dtype), ctx)
    res = {p: {"dtype": dtype, "path": p, "warmup_calls_s": [], "calls_s": [], "tokens": [], "decoded": []}
           for p in paths}  # fmt: skip
    last = {}
    try:
        for path in paths:
            with decoding_path(engines, path) as engine:
                for _ in range(args.warmup):
                    res[path]["warmup_calls_s"].append(timed_rollout(engine, prompts, sampling)[0])
                    engine.metrics()  # read: the next call's figures are its own
        for _ in range(args.rounds):
            for path in paths:
                with decoding_path(engines, path) as engine:
                    for _ in range(args.calls):
                        seconds, last[path] = timed_rollout(engine, prompts, sampling)
                        res[path]["calls_s"].append(seconds)
                        res[path]["tokens"].append(sum(map(len, last[path].token_ids)))
                        res[path]["decoded"].append(engine.metrics().get("hf/decoded_row_fraction"))
        if args.profile:
            res["decode"]["profile"] = profile_decode(engines["decode"], prompts, sampling)
    finally:
        for engine in engines.values():
            engine.close()
    for path, r in res.items():
        r["warmup_s"] = sum(r["warmup_calls_s"])
        r["median_s"] = statistics.median(r["calls_s"])
        r["tokens_per_s"] = sum(r["tokens"]) / sum(r["calls_s"])
        r["mean_length"] = sum(r["tokens"]) / len(r["tokens"]) / (len(prompts) * sampling.n)
        known = [d for d in r["decoded"] if d is not None]
        r["decoded_row_fraction"] = sum(known) / len(known) if known else None
        r["over_decode"] = r["median_s"] / res["decode"]["median_s"]
        r["same_token_fraction"] = same_token_fraction(last["decode"], last[path])
        r["logprob_diff_mean"], r["logprob_diff_max"] = logprob_diff(run, prompts, last[path], sampling.n)
    return res


def measure_engines(args, ctx, run, prompts, sampling) -> None:
    """Every engine dtype's rows, into R and the JSON as each is done, and printed."""
    step = 0
    for dtype in args.dtypes.split(","):
        R["engines"][dtype] = run_engine(args, ctx, dtype, run, prompts, sampling)
        common.write_json(R, common.out_path(args.out, "hf_engine.json"))
        for row in R["engines"][dtype].values():
            step += 1
            common.print_row({"step": step, **row}, COLUMNS)
        prof = R["engines"][dtype]["decode"].get("profile")
        if prof:
            print(
                f"profile ({dtype}, decode): {prof['ms_per_token']:.2f} ms a token, GPU busy "
                f"{prof['gpu_busy_fraction']:.0%} of the call, {prof['kernels_per_token']:.0f} kernels a token"
            )
            for k in prof["top_kernels"]:
                print(f"  {k['total_ms']:>9.1f} ms {k['calls']:>7} x {k['mean_us']:>7.1f} us  {k['name']}")


def main(args) -> None:
    import torch
    import transformers

    common.use_checkout("algo_grpo")
    from hybridrl.components import RunContext, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cpu" if args.smoke else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_hf_engine: no CUDA GPU visible; --smoke runs the CPU check of the script.")
    workdir = Path(args.workdir or Path(tempfile.gettempdir()) / "hybridrl-vs-trl").absolute()
    shape = {"0.5b": ("qwen2.5-0.5b-shaped", common.QWEN05), "3b": ("qwen2.5-3b-shaped", common.QWEN3B)}[args.shape]
    folder, dims = (workdir / "tiny", common.TINY) if args.smoke else (workdir / shape[0], shape[1])
    rate = 0.0 if args.lengths == "fixed" else 4 / args.max_tokens
    folder = folder.with_name(folder.name + (f"-end-rate-{rate:.4g}" if rate else ""))
    model_dir = args.model or common.build_model(folder, dims, end_rate=rate)
    R["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    R["machine"] = platform.machine() + (f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "")
    R["versions"] = {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__}  # fmt: skip
    R["config"] = {
        "model": model_dir,
        "shape": args.shape,
        "device": str(device),
        "prompts": args.prompts,
        "prompt_tokens": args.prompt_chars,
        "n": args.n,
        "max_tokens": args.max_tokens,
        "temperature": 1.0,
        "ignore_eos": args.lengths == "fixed",
        "lengths": args.lengths,
        "seed": 0,
        "engine": {"compile": "on", "cache": "static"},
        "dtypes": args.dtypes,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "calls": args.calls,
        "paths": args.paths,
        "profile": args.profile,
    }
    tokenizer = common.load_tokenizer(model_dir)
    ctx = RunContext(model_dir, tokenizer, device, torch.float32, 0, workdir / "run")
    prompts = [tokenizer(common.prompt(i, args.prompt_chars))["input_ids"] for i in range(args.prompts)]
    sampling = SamplingParams(
        n=args.n, max_tokens=args.max_tokens, temperature=1.0, ignore_eos=args.lengths == "fixed", seed=0
    )
    run = common.scoring_run(model_dir, device, workdir)  # the trainer's side of the logprobs: a float32 policy
    try:
        measure_engines(args, ctx, run, prompts, sampling)
    finally:
        run.close()
    R["summary"] = {
        f"{dtype}_{key}": float(f"{R['engines'][dtype][path][field]:.4g}")
        for dtype in R["engines"]
        for key, path, field in (
            ("decode_s", "decode", "median_s"),
            ("generate_s", "generate", "median_s"),
            ("generate_over_decode", "generate", "over_decode"),
            ("same_token_fraction", "generate", "same_token_fraction"),
            ("decode_logprob_diff_max", "decode", "logprob_diff_max"),
        )
        if path in R["engines"][dtype]
    }
    R["ok"] = True


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-chars", type=int, default=common.PROMPT_CHARS, help="prompt length (one token a byte)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per path first (they compile)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of timed calls, the paths alternating")
    p.add_argument("--calls", type=int, default=2, help="timed calls per path and round")
    p.add_argument("--dtypes", default="bfloat16,float32", help="engine dtypes, ','-separated")
    p.add_argument("--workdir", default=None, help="where the model is built (default: the temp dir)")
    p.add_argument("--out", default=None, help="JSON file (default: $OUT/hf_engine.json or ./hf_engine.json)")
    p.add_argument("--smoke", action="store_true", help="CPU check of the script: tiny model, small sizes")
    p.add_argument("--device", default=None, help="default: cuda (--smoke: cpu)")
    p.add_argument("--model", default=None, help="an HF model folder instead of the reference model")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--shape", choices=("0.5b", "3b"), default="0.5b", help="the random model's shape")
    paths = ", ".join(PATHS)
    p.add_argument("--paths", default=",".join(PATHS), help=f"decoding paths, ','-separated: {paths}, decode:K")
    p.add_argument("--profile", action="store_true", help="then profile one call of the decoding loop")
    p.add_argument("--lengths", choices=("fixed", "long-tail"), default="fixed", help="EOS ignored, or long-tail")
    args = p.parse_args(argv)
    if args.smoke:
        args.prompts, args.n, args.max_tokens, args.prompt_chars = 2, 2, 16, 32
        args.warmup, args.rounds, args.calls = 1, 2, 1
    return args


if __name__ == "__main__":
    args = parse_args()
    common.run_and_exit(main, args, R, common.out_path(args.out, "hf_engine.json"))
