#!/usr/bin/env python3
"""hybridrl vs TRL's GRPOTrainer on the reference configuration, one command, one GPU.

    python benchmarks/gpu_vs_trl.py                          # all four sides, one after the other
    python benchmarks/gpu_vs_trl.py --sides trl-hf,hybridrl-hf
    python benchmarks/gpu_vs_trl.py --smoke                  # CPU check of the script (tiny model)
    python benchmarks/gpu_vs_trl.py --lengths long-tail --bare   # realistic lengths; plugin vs bare vLLM
    python benchmarks/gpu_vs_trl.py --shape 3b --trl-options '{"gradient_checkpointing": false,
        "per_device_train_batch_size": 8, "gradient_accumulation_steps": 8}'

The reference configuration: GRPO on a Qwen2.5-0.5B-shaped model (random weights, see
common.py), float32 master weights with bf16 compute, prompts of exactly 128 tokens, 8 prompts
x 8 samples = 64 completions of exactly 256 tokens per step (EOS ignored), one optimizer update
per step, KL loss k3 with beta 0.04 (a reference model on both sides), AdamW at lr 1e-6 (``--lr``;
1e-9 with long-tail lengths, below).
``--shape 3b``: a Qwen2.5-3B-shaped model instead. ``--lengths long-tail``: responses end at
random lengths (geometric, mean about max_tokens / 4, about 1.8% at max_tokens: see
``common.raise_end_logits``), the same distribution on every side; tokens per second then count
the tokens generated. The end ids' raised logits make the lengths very sensitive to the
weights: at lr 1e-6 the updates learn them within a few steps (on the CPU, with the full
vocabulary, mean lengths 12.6, 10.2, 6.0, 3.9 over four steps; on an H200 they rose from 80
to 150-170), each side its own way; at 1e-9 they stay put (12.6, 14.8, 13.9, 14.6), and a step
does the same work at any learning rate. TRL runs with ``--trl-options`` over its defaults, by default
``gradient_checkpointing: false``, its fastest setting here; hybridrl with its defaults and
``--trainer-options``/``--sharding``/``--engine-options`` (``--vllm-options`` for its vllm side
alone). ``--bare``: the vllm side also times
the same engine called directly with the prompts of its last step, and profiles one call.

Sides, each in its own process (two in-process vLLM engines do not share one process), run back
to back: ``trl-hf`` (TRL 1.16 defaults, transformers generation), ``trl-vllm`` (TRL with its
colocated vLLM engine), ``hybridrl-hf`` (the built-in ``hf`` engine) and ``hybridrl-vllm`` (the
vllm plugin, in-process). Each runs ``--warmup`` steps, then ``--steps`` timed steps; a step is
timed from its start to its end with the GPU synchronised. Prints a table and writes JSON
(``--out``; default ``$OUT/vs_trl_gpu.json`` when OUT is set, else ``./vs_trl_gpu.json``),
after every side, so a failing side keeps the others' figures.
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
import traceback
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
SIDES = ["trl-hf", "hybridrl-hf", "hybridrl-vllm", "trl-vllm"]
LONG_TAIL_LR = 1e-9  # the default --lr with long-tail lengths
# KL loss k3 with beta 0.04 against a reference on both; ppo (hybridrl sides only): GAE with a critic
ALGORITHMS = {
    "grpo": {"name": "grpo", "kl_coef": 0.04, "kl_kind": "k3"},
    "ppo": {"name": "ppo", "use_kl_loss": True, "kl_loss_coef": 0.04, "kl_loss_type": "k3", "critic": True},
}


# -- hybridrl ------------------------------------------------------------------------------


def run_hybridrl(args, engine: str, result: dict) -> None:
    common.use_checkout(f"algo_{args.algorithm}", *(["rollout_vllm"] if engine == "vllm" else []))
    from pydantic import Field

    from hybridrl import plugins
    from hybridrl.components import Options as BaseOptions
    from hybridrl.components import PromptSource, RewardFunction
    from hybridrl.config import load_config
    from hybridrl.run import build_run
    from hybridrl.trainer import Trainer

    class Prompts(PromptSource):
        class Options(BaseOptions):
            size: int = Field(4096, gt=0)

        def __len__(self):
            return self.options.size

        def __getitem__(self, i):
            return {"question": common.prompt(i), "answer": None}

    class EvenBytes(RewardFunction):
        def score(self, batch):
            return [common.even_byte_fraction(t) for t in batch["response_text"]]

    pm = plugins.get_plugin_manager()
    pm.register(common.bench_plugin({"bench_prompts": Prompts}, {"even_bytes": EvenBytes}), name="bench-vs-trl")
    plugins.invalidate_registry()

    fixed = args.lengths == "fixed"
    rollout = {"engine": engine, "n": args.n, "max_tokens": args.max_tokens, "temperature": 1.0, "ignore_eos": fixed}
    if engine == "vllm":
        rollout |= {
            "dtype": "float32" if args.smoke else "bfloat16",
            "max_model_len": common.PROMPT_CHARS + args.max_tokens + 16,
            "engine_kwargs": {"skip_tokenizer_init": True},
            **({} if args.smoke else {"gpu_memory_utilization": args.gpu_memory_utilization}),
        }
    # the timed steps stand for those of a long run, where compile auto compiles what a few steps do not
    # pay back: hf decoding from two million planned response tokens (123 steps of the reference
    # configuration), the single strategy's passes from four million trained tokens (163 such steps)
    sharding = {"compile": "on"} if not args.smoke else {}
    if engine == "hf" and not args.smoke:
        rollout["compile"] = "on"
    rollout |= json.loads(args.engine_options) | (json.loads(args.vllm_options) if engine == "vllm" else {})
    cfg = {
        "model": {"path": args.model, "dtype": "float32"},
        "data": {"source": "bench_prompts", "chat_template": False, "answer_column": None},
        "rollout": rollout,
        "rewards": [{"function": "even_bytes"}],
        "algorithm": ALGORITHMS[args.algorithm],
        "sharding": {"strategy": "single", **sharding, **json.loads(args.sharding)},
        "trainer": {
            "steps": args.warmup + args.steps,
            "prompts_per_step": args.prompts,
            "lr": args.lr,
            "seed": 0,
            "device": "cpu" if args.smoke else "cuda",
            "run_dir": str(Path(args.workdir) / f"hybridrl-{engine}-{int(time.time())}"),
            "sample_every": 0,
            **json.loads(args.trainer_options),
        },
        "logging": {"loggers": []},
    }
    result["config"] = cfg
    config = load_config(data=cfg)
    t = time.perf_counter()
    trainer = Trainer(build_run(config, name="bench"))
    result["setup_s"] = round(time.perf_counter() - t, 1)
    try:
        measure_hybridrl(args, trainer, engine, result)
    finally:
        trainer.close()


def measure_hybridrl(args, trainer, engine: str, result: dict) -> None:
    """The hybridrl side's steps, each timed, then with vllm the sync sweep and the bare engine."""
    calls = record_calls(trainer.run.engine)
    trainer.open(args.warmup + args.steps)  # as train() does; this drives step() itself, to time each
    keep = ("rollout", "logprobs", "update", "sync", "sync_check", "reward", "advantages")
    for step in range(1, args.warmup + args.steps + 1):
        common.wait_for_gpu()
        start = time.perf_counter()
        m = trainer.step(step)
        common.wait_for_gpu()
        row = {"step": step, "step_s": time.perf_counter() - start}
        row |= {f"{k}_s": m.get(f"timing/{k}", 0.0) for k in keep}
        row |= {k.split("/")[-1]: m[k] for k in THROUGHPUT if k in m}
        row["compile_s"] = m.get("timing/compile")  # torch.compile's, this step
        row |= {k.split("/")[-1]: m[k] for k in m if k.startswith("hf/graph_")}  # a slow step's decoding work
        row["reward"] = m.get("reward/mean")
        row["response_length"] = m.get("response_length/mean")
        row["logprob_diff_mean"] = m.get("rollout/logprob_diff_mean")  # engine vs trainer, same weights
        row["decoded_row_fraction"] = m.get("hf/decoded_row_fraction")  # the hf engine's compact_rows
        result["steps"].append(row)
        print(f"[{result['side']}] step {step}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items() if v), flush=True)
        dump_side(args, result)
    if engine == "vllm" and args.sync_sweep:
        result["sync_sweep"] = sync_sweep(trainer)
        dump_side(args, result)
    if engine == "vllm" and args.bare:
        largest = max(calls, key=lambda c: len(c[0]) * c[1].n)  # a rollout, not a sync check's probe
        result["bare"] = bare_vllm(trainer.run.engine, *largest)
        dump_side(args, result)


def number(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def record_calls(engine) -> list:
    """Keep the (prompts, sampling) of each ``engine.generate`` call."""
    calls, generate = [], engine.generate

    def recorded(prompts, sampling):
        calls.append((prompts, sampling))
        return generate(prompts, sampling)

    engine.generate = recorded
    return calls


def bare_vllm(engine, prompts, sampling, reps: int = 3) -> dict:
    """The vllm plugin's generate against its vLLM engine called directly, on the same prompts:
    with the plugin's parameters (a seed per prompt unless ``seed_requests`` is false, the
    sampled token's logprob), with one unseeded parameter set, and without logprobs; medians of
    ``reps``, then a profile of one plugin call (where its time goes)."""
    from vllm import SamplingParams as VSP

    local = engine.backend  # the plugin's in-process engine: its vllm.LLM and request parameters
    inputs = [{"prompt_token_ids": list(p)} for p in prompts]
    seeded = local.sampling_params(sampling, len(prompts))
    one = seeded[0] if isinstance(seeded, list) else seeded
    same = {k: getattr(one, k) for k in ("n", "temperature", "top_p", "top_k", "max_tokens", "ignore_eos")}
    unseeded, no_logprobs = VSP(**same, logprobs=0, detokenize=False), VSP(**same, detokenize=False)
    variants = {
        "plugin generate": lambda: sum(map(len, engine.generate(prompts, sampling).token_ids)),
        "vLLM, the plugin's parameters": lambda: count(local.llm.generate(inputs, seeded, use_tqdm=False)),
        "vLLM, unseeded": lambda: count(local.llm.generate(inputs, unseeded, use_tqdm=False)),
        "vLLM, unseeded, no logprobs": lambda: count(local.llm.generate(inputs, no_logprobs, use_tqdm=False)),
    }
    out = {}
    for name, fn in variants.items():
        times, tokens = [], 0
        for _ in range(reps):
            common.wait_for_gpu()
            start = time.perf_counter()
            tokens = fn()
            common.wait_for_gpu()
            times.append(time.perf_counter() - start)
        out[name] = {"median_s": statistics.median(times), "tokens": tokens,
                     "tokens_per_s": tokens / statistics.median(times)}  # fmt: skip
        print(f"bare: {name}: {out[name]}", flush=True)
    out["profile_by_own_time"] = profile(lambda: engine.generate(prompts, sampling), "tottime", 25)
    return out


def count(results) -> int:
    return sum(len(c.token_ids) for r in results for c in r.outputs)


def sync_sweep(trainer, reps: int = 3) -> dict:
    """Weight sync seconds (median of ``reps``) for several bucket sizes, the engine awake."""
    run = trainer.run
    engine, strategy, policy = run.engine, run.strategy, run.policy  # the engine's weights sent, around the session
    out = {}
    for mib in (128, 512, 2048, 8192):
        engine.options.update_bucket_mb = mib
        times = []
        for _ in range(reps):
            common.wait_for_gpu()
            start = time.perf_counter()
            engine.update_weights(strategy.full_tensors(policy))
            common.wait_for_gpu()
            times.append(time.perf_counter() - start)
        out[f"{mib} MiB"] = {"median_s": statistics.median(times), "all_s": times,
                             "buckets": engine.metrics().get("vllm/sync_buckets")}  # fmt: skip
        print(f"sync, buckets of {mib} MiB: {out[f'{mib} MiB']}", flush=True)
    import torch

    times = []
    for _ in range(reps):  # the engine's dtype sent: the conversion happens before the engine's loaders
        common.wait_for_gpu()
        start = time.perf_counter()
        tensors = strategy.full_tensors(policy)
        engine.update_weights((n, t.to(torch.bfloat16) if t.is_floating_point() else t) for n, t in tensors)
        common.wait_for_gpu()
        times.append(time.perf_counter() - start)
    out["8192 MiB, bf16 sent"] = {"median_s": statistics.median(times), "all_s": times}
    print(f"sync, bf16 sent: {out['8192 MiB, bf16 sent']}", flush=True)
    out["profile"] = profile(lambda: engine.update_weights(strategy.full_tensors(policy)))
    return out


def profile(fn, sort: str = "cumulative", rows: int = 30) -> str:
    """cProfile's table of one call of ``fn`` (the GPU waited for), printed and returned."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    common.wait_for_gpu()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats(sort).print_stats(rows)
    print(text.getvalue()[-8000:], flush=True)
    return text.getvalue()[-8000:]


THROUGHPUT = (
    "throughput/rollout_tokens_per_s",
    "throughput/train_tokens_per_s",
    "throughput/update_tflops",
    "throughput/update_mfu",
)


# -- TRL ----------------------------------------------------------------------------------


def run_trl(args, vllm: bool, result: dict) -> None:
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    result["versions"]["trl"] = trl.__version__
    if args.algorithm != "grpo":
        raise SystemExit(f"TRL's GRPOTrainer runs --algorithm grpo only, not {args.algorithm}")
    data = Dataset.from_list([{"prompt": common.prompt(i)} for i in range(1024)])

    def even_bytes(completions, **_):
        return [common.even_byte_fraction(c) for c in completions]

    extra = {"use_cpu": True} if args.smoke else {}
    if vllm:
        extra |= {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": args.gpu_memory_utilization}
    if args.lengths == "fixed":  # EOS ignored
        extra["generation_kwargs"] = {"ignore_eos": True} if vllm else {"min_new_tokens": args.max_tokens}
    extra |= json.loads(args.trl_options)
    config = common.trl_grpo_config(
        str(Path(args.workdir) / "trl"),
        args.prompts,
        args.n,
        args.max_tokens,
        learning_rate=args.lr,
        max_steps=args.warmup + args.steps,
        logging_steps=1,
        **extra,
    )
    result["trl_defaults"] = {
        k: getattr(config, k)
        for k in (
            "bf16",
            "gradient_checkpointing",
            "loss_type",
            "num_iterations",
            "steps_per_generation",
            "per_device_train_batch_size",
            "gradient_accumulation_steps",
            "learning_rate",
        )  # fmt: skip
        if hasattr(config, k)
    }
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args.model)

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            common.wait_for_gpu()
            self.start = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            common.wait_for_gpu()
            row = {"step": state.global_step, "step_s": time.perf_counter() - self.start}
            result["steps"].append(row)
            print(f"[{result['side']}] step {row['step']}: {row['step_s']:.3f} s", flush=True)
            dump_side(args, result)

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and result["steps"]:
                result["steps"][-1]["trl_log"] = {k: number(v) for k, v in logs.items() if number(v) is not None}

    t = time.perf_counter()
    trainer = GRPOTrainer(
        model=model, reward_funcs=even_bytes, args=config, train_dataset=data, processing_class=tok, callbacks=[Clock()]
    )
    result["setup_s"] = round(time.perf_counter() - t, 1)
    trainer.train()


# -- one side, in its own process -----------------------------------------------------------


def dump_side(args, result: dict) -> None:
    Path(args.result).write_text(json.dumps(result, indent=1, default=str) + "\n")


def side_main(args) -> int:
    import torch
    import transformers

    result = {"side": args.side, "steps": [], "ok": False}
    result["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    code = 0
    try:
        framework, engine = args.side.split("-")
        if engine == "vllm":
            import vllm

            result["versions"]["vllm"] = vllm.__version__
        if framework == "trl":
            run_trl(args, engine == "vllm", result)
        else:
            run_hybridrl(args, engine, result)
        result["ok"] = True
    except BaseException as e:  # noqa: BLE001 - keep the figures so far and say what failed
        result["error"] = repr(e)[:2000]
        result["traceback"] = traceback.format_exc()[-6000:]
        traceback.print_exc()
        code = 1
    if torch.cuda.is_available():  # the side's peak over its whole run, its engine included
        result["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    dump_side(args, result)
    sys.stdout.flush()
    os._exit(code)  # engines' background threads must not keep the process alive


# -- the whole comparison -------------------------------------------------------------------


def summarize(side: dict, args) -> dict:
    timed = side["steps"][args.warmup :]
    if not timed:
        return {}

    def med(key):
        values = [r[key] for r in timed if r.get(key) is not None]
        return statistics.median(values) if values else None

    for r in timed:  # TRL logs its mean completion length
        r.setdefault("response_length", r.get("trl_log", {}).get("completions/mean_length"))
    out = {"timed_steps": len(timed), "step_s": med("step_s"), "peak_gib": side.get("peak_gib")}
    out["steps_per_s"] = 1 / out["step_s"]
    length = args.max_tokens if args.lengths == "fixed" else med("response_length")
    out["response_length_mean"] = length
    if length:
        out["generated_tokens_per_s_whole_step"] = args.prompts * args.n * length / out["step_s"]
    for key in ("rollout_s", "logprobs_s", "update_s", "sync_s", "sync_check_s", "rollout_tokens_per_s",
                "train_tokens_per_s", "update_tflops", "update_mfu", "decoded_row_fraction"):  # fmt: skip
        if med(key) is not None:
            out[key] = med(key)
    return out


def ratios(summary: dict) -> dict:
    s = {k: v.get("step_s") for k, v in summary.items() if v.get("step_s")}
    out = {}
    for engine in ("hf", "vllm"):
        if f"trl-{engine}" in s and f"hybridrl-{engine}" in s:
            out[f"trl_{engine}_over_hybridrl_{engine}"] = s[f"trl-{engine}"] / s[f"hybridrl-{engine}"]
    trl = [v for k, v in s.items() if k.startswith("trl")]
    ours = [v for k, v in s.items() if k.startswith("hybridrl")]
    if trl and ours:
        out["best_trl_over_best_hybridrl"] = min(trl) / min(ours)
    return out


COLUMNS = [
    ("side", None, "{:<14}"),
    ("step s", "step_s", "{:>7.3f}"),
    ("steps/s", "steps_per_s", "{:>7.3f}"),
    ("gen tok/s (step)", "generated_tokens_per_s_whole_step", "{:>16,.0f}"),
    ("rollout s", "rollout_s", "{:>9.3f}"),
    ("rollout tok/s", "rollout_tokens_per_s", "{:>13,.0f}"),
    ("logprobs s", "logprobs_s", "{:>10.3f}"),
    ("update s", "update_s", "{:>8.3f}"),
    ("train tok/s", "train_tokens_per_s", "{:>11,.0f}"),
    ("MFU", "update_mfu", "{:>6.1%}"),
    ("sync s", "sync_s", "{:>6.3f}"),
    ("check s", "sync_check_s", "{:>7.3f}"),
]


FORWARD = ("algorithm", "prompts", "n", "max_tokens", "lr", "warmup", "steps", "gpu_memory_utilization", "sharding",
           "engine_options", "vllm_options", "trainer_options", "trl_options", "lengths")  # fmt: skip


def main(args) -> int:
    import torch

    out = Path(args.out) if args.out else Path(os.environ.get("OUT", ".")) / "vs_trl_gpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(args.workdir or Path(tempfile.gettempdir()) / "hybridrl-vs-trl").absolute()
    shape = common.TINY if args.smoke else {"0.5b": common.QWEN05, "3b": common.QWEN3B}[args.shape]
    name = "tiny" if args.smoke else f"qwen2.5-{args.shape}-shaped"
    rate = 0.0 if args.lengths == "fixed" else 4 / args.max_tokens
    model = common.build_model(workdir / (name + (f"-end-rate-{rate:.4g}" if rate else "")), shape, end_rate=rate)
    R = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine() + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""),
        "config": {k: v for k, v in vars(args).items() if k not in ("side", "result")} | {"model": model},
        "sides": {},
    }
    for side in args.sides.split(","):
        if side not in SIDES:
            raise SystemExit(f"unknown side '{side}'; choose from {', '.join(SIDES)}")
        result_file = workdir / f"{side}.json"
        result_file.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--side", side, "--result", str(result_file), "--model", model]
        for key in FORWARD:
            cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
        cmd += ["--workdir", str(workdir)] + (["--smoke"] if args.smoke else []) + (["--bare"] if args.bare else [])
        cmd += ["--sync-sweep"] if args.sync_sweep else []
        start = time.perf_counter()
        try:
            code = subprocess.run(cmd, timeout=args.side_timeout).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        side_result = json.loads(result_file.read_text()) if result_file.is_file() else {"steps": []}
        side_result |= {"exit": code, "wall_s": round(time.perf_counter() - start, 1)}
        side_result["summary"] = summarize(side_result, args)
        R["sides"][side] = side_result
        R["summary"] = {k: v["summary"] for k, v in R["sides"].items() if v["summary"]}
        R["ratios"] = ratios(R["summary"])
        out.write_text(json.dumps(R, indent=1, default=str) + "\n")
    common.print_sides(R, COLUMNS, out)
    return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, from {', '.join(SIDES)}")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vLLM's share on both sides")
    p.add_argument("--sharding", default="{}", help="JSON of hybridrl sharding options (strategy single)")
    p.add_argument("--engine-options", default="{}", help="JSON of extra hybridrl rollout options")
    p.add_argument("--vllm-options", default="{}", help="JSON of extra rollout options of the hybridrl-vllm side")
    p.add_argument("--trainer-options", default="{}", help="JSON of extra hybridrl trainer options")
    p.add_argument("--trl-options", default='{"gradient_checkpointing": false}', help="JSON over TRL's GRPOConfig")
    p.add_argument("--shape", choices=["0.5b", "3b"], default="0.5b")
    p.add_argument("--algorithm", choices=list(ALGORITHMS), default="grpo", help="ppo: hybridrl sides only")
    p.add_argument("--lengths", choices=["fixed", "long-tail"], default="fixed")
    p.add_argument("--lr", type=float, default=None, help="both sides; default 1e-6, 1e-9 with long-tail lengths")
    p.add_argument("--bare", action="store_true", help="vllm side: also time the bare engine, profile a call")
    p.add_argument("--sync-sweep", action="store_true", help="vllm side: also time weight syncs by bucket size")
    p.add_argument("--side-timeout", type=float, default=900)
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="CPU check of the script: tiny model, small sizes")
    p.add_argument("--side", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.lr is None:  # long-tail lengths would be learned at 1e-6 (see the docstring)
        args.lr = LONG_TAIL_LR if args.lengths == "long-tail" else 1e-6
    if args.smoke and not args.side:
        args.prompts, args.n, args.max_tokens, args.warmup, args.steps = 2, 4, 8, 1, 1
    return args


if __name__ == "__main__":
    a = parse_args()
    sys.exit(side_main(a) if a.side else main(a))
