#!/usr/bin/env python3
"""hybridrl vs verl 0.9 on one GPU: the same model, prompts, reward and hyper-parameters.

    python benchmarks/gpu_vs_verl.py                                  # verl, hybridrl-vllm, hybridrl-hf
    python benchmarks/gpu_vs_verl.py --sides verl --warmup 0 --steps 1   # smoke: ray.init and one verl step
    python benchmarks/gpu_vs_verl.py --prompts 64                     # 64 x 8 x 256 (verl alone: about 390 s)
    python benchmarks/gpu_vs_verl.py --lengths long-tail              # realistic response lengths
    python benchmarks/gpu_vs_verl.py --algorithm ppo                  # PPO with a critic (GAE) on both
    python benchmarks/gpu_vs_verl.py --sides verl --verl-options "actor_rollout_ref.rollout.free_cache_engine=False"
    python benchmarks/gpu_vs_verl.py --sides verl --verl-options "actor_rollout_ref.model.use_fused_kernels=False"
                                                  # verl's defaults (fused kernels are this script's)

The reference configuration of ``gpu_vs_trl.py``: a Qwen2.5-0.5B-shaped model (random weights,
bf16 on disk), float32 master weights with bf16 compute on both sides, prompts of exactly 128
tokens, 8 prompts x 8 samples of exactly 256 tokens per step (EOS ignored; ``--lengths long-tail``:
responses end at random, see gpu_vs_trl.py), one optimizer update per step, KL loss k3 with beta
0.04 against a reference, AdamW at lr 1e-6 (1e-9 with long-tail lengths), the fraction of even
bytes as the reward. verl reads the prompts from a verl-format parquet (chat ``prompt``,
``data_source``, ``reward_model.ground_truth``) and the reward from a ``compute_score`` file; its
chat template is the prompt's text alone, so both sides see the same 128 tokens.

Sides, each its own process, back to back: ``verl`` (``python -m verl.trainer.main_ppo``: its v1
trainer, FSDP and a colocated vLLM server on the one GPU, with the overrides of
:func:`verl_overrides` and ``--verl-options``), ``hybridrl-vllm`` and ``hybridrl-hf``
(gpu_vs_trl.py's sides with hybridrl's defaults: the vllm engine's ``sleep_level: auto``, which keeps
it awake while a model of this size trains, the hf engine and the single strategy compile only when
the run is long enough; ``--vllm-options``, ``--hf-options``, ``--sharding`` and ``--trainer-options``
change them).
verl runs without flash-attn (not installable there): sdpa attention and no remove-padding path,
with its fused kernels (torch backend: log-probs from hidden states in chunks), its fastest setting
there; its PPO critic, which asks for flash-attn by name, is built with sdpa through a module that verl
imports in all its processes, named in its ``VERL_USE_EXTERNAL_MODULES`` (``gpu/verl/verl_critic_sdpa.py``).
Step times are each framework's own step timer, over the steps after ``--warmup``; the peak is the
GPU's memory in use by all processes (nvidia-smi, sampled every 0.5 s); MFU is counted the same
way for both (matrix FLOPs of the update's forward and backward passes, as the trainer counts them
for its ``throughput/update_mfu``, against the bf16 peak its metrics imply), verl's own figure
beside it. Prints a table and writes JSON (``--out``; default ``$OUT/vs_verl_gpu.json`` when OUT is
set).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SIDES = ["verl", "hybridrl-vllm", "hybridrl-hf"]
VERL_RECIPE = Path(__file__).resolve().parent / "gpu" / "verl"
CRITIC_SDPA = "verl_critic_sdpa"  # in VERL_RECIPE: builds verl's PPO critic with sdpa (its docstring says why)
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the prompt's text, nothing added
REWARD = '''\
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """The fraction of even bytes of the response (benchmarks/common.py's even_byte_fraction)."""
    data = solution_str.encode()
    return sum(1 for b in data if b % 2 == 0) / len(data) if data else 0.0
'''


# -- verl ---------------------------------------------------------------------------------


def write_verl_inputs(workdir: Path, prompts: int) -> tuple[Path, Path]:
    """The prompts as a verl-format parquet, and the reward as a compute_score file."""
    import pandas as pd

    rows = [
        {"data_source": "even_bytes", "prompt": [{"role": "user", "content": common.prompt(i)}],
            "reward_model": {"style": "rule", "ground_truth": ""}, "extra_info": {"index": i}}
        for i in range(max(1024, prompts * 64))
    ]  # fmt: skip
    data, reward = workdir / "prompts.parquet", workdir / "even_bytes_reward.py"
    pd.DataFrame(rows).to_parquet(data)
    reward.write_text(REWARD)
    return data, reward


def verl_overrides(args, model: str, data: Path, reward: Path) -> list[str]:
    """verl's single-GPU FSDP + colocated vLLM settings for this configuration. Speed choices, each
    verl's faster setting where memory allows: no gradient checkpointing, dynamic micro-batches
    of up to 24,576 tokens (verl's default 16,384), vLLM with CUDA graphs, fused kernels (2.7x
    its default step, 4.10 s against 11.11 s, BENCHMARKS.md)."""
    # tokens a micro-batch: the reference configuration's step in one pass; more ran out of memory
    # (64 x 8 x 384 tokens in one log-prob pass asked for 111 GiB of logits)
    tokens = min(args.prompts * args.n * (common.PROMPT_CHARS + args.max_tokens), 24576)
    o = [
        f"algorithm.adv_estimator={'gae' if args.algorithm == 'ppo' else 'grpo'}",
        f"data.train_files={data}", f"data.val_files={data}",
        f"data.train_batch_size={args.prompts}", f"data.max_prompt_length={common.PROMPT_CHARS}",
        f"data.max_response_length={args.max_tokens}", "data.shuffle=False", "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.model.use_remove_padding=False",  # needs flash-attn
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "actor_rollout_ref.model.use_fused_kernels=True",  # without flash-attn, its torch backend
        "actor_rollout_ref.model.fused_kernel_options.impl_backend=torch",
        f"actor_rollout_ref.actor.optim.lr={args.lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",  # one optimizer update per step
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={tokens}",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.04",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.rollout.n={args.n}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={args.gpu_memory_utilization}",
        f"actor_rollout_ref.rollout.ignore_eos={args.lengths == 'fixed'}",
        f"reward.custom_reward_function.path={reward}", "reward.custom_reward_function.name=compute_score",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.logger=[console,file]",
        "trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.save_freq=-1",
        f"trainer.total_training_steps={args.warmup + args.steps}", "trainer.total_epochs=1000",
        "trainer.project_name=hybridrl_bench", "trainer.experiment_name=verl",
    ]  # fmt: skip
    if args.algorithm == "ppo":
        o += [f"critic.model.path={model}", "critic.model.use_remove_padding=False",
              "+critic.model.override_config.attn_implementation=sdpa",
              "critic.model.enable_gradient_checkpointing=False", "critic.optim.lr=1e-5",
              f"critic.ppo_max_token_len_per_gpu={tokens}"]  # fmt: skip
    if args.profile_step:  # verl's own torch profiler, one trace per stage of that step
        o += ["global_profiler.tool=torch", f"global_profiler.steps=[{args.profile_step}]",
              f"global_profiler.save_path={Path(args.workdir_abs) / 'verl_profile'}",
              "actor_rollout_ref.actor.profiler.enable=True",
              "actor_rollout_ref.actor.profiler.tool_config.torch.discrete=True",
              "actor_rollout_ref.rollout.profiler.enable=False"]  # fmt: skip
    return o + shlex.split(args.verl_options)


def trace_summary(folder: Path, top: int = 25) -> dict:
    """Each torch-profiler trace under ``folder`` (verl's, one a stage): the span it covers and the
    operators and kernels that took the most time, summed by name (milliseconds)."""
    out = {}
    for path in sorted(folder.rglob("*.json*")):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
        if not events:
            continue
        start, end = min(e["ts"] for e in events), max(e["ts"] + e["dur"] for e in events)
        by = {}
        for e in events:
            key = f"{e.get('cat', '?')}: {e.get('name', '?')[:120]}"
            by[key] = by.get(key, 0.0) + e["dur"] / 1000
        kinds = {}
        for e in events:
            kinds[e.get("cat", "?")] = kinds.get(e.get("cat", "?"), 0) + 1
        ranked = sorted(by.items(), key=lambda kv: -kv[1])[:top]
        out[path.name] = {"span_ms": (end - start) / 1000, "events": kinds, "top_ms": dict(ranked)}
    return out


def run_verl(args, model: str, workdir: Path) -> dict:
    """verl's trainer in its own process; its per-step metrics come from its file logger."""
    import verl

    data, reward = write_verl_inputs(workdir, args.prompts)
    log = workdir / "verl_metrics.jsonl"
    log.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *verl_overrides(args, model, data, reward)]
    env = os.environ | {"VERL_FILE_LOGGER_PATH": str(log), "HYDRA_FULL_ERROR": "1", "RAY_DEDUP_LOGS": "0"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(VERL_RECIPE), env.get("PYTHONPATH")]))  # CRITIC_SDPA
    if args.algorithm == "ppo" and importlib.util.find_spec("flash_attn") is None:
        # verl's critic asks for flash-attn by name; verl imports the modules this names in every one of its
        # processes (critic.model.external_lib is imported only where the config is built, not in the workers)
        env["VERL_USE_EXTERNAL_MODULES"] = CRITIC_SDPA
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # verl's vLLM server runs its engine in its own processes
    result = {"side": "verl", "versions": {"verl": verl.__version__}, "command": shlex.join(cmd)}
    print(result["command"], flush=True)
    try:
        result["exit"] = subprocess.run(cmd, cwd=workdir, env=env, timeout=args.side_timeout).returncode
    except subprocess.TimeoutExpired:
        result["exit"] = "timeout"
    subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], capture_output=True)
    lines = log.read_text().splitlines() if log.is_file() else []
    result["steps"] = [verl_row(json.loads(line)) for line in lines if line.strip()]
    every_step = len(result["steps"]) == args.warmup + args.steps
    result["ok"] = every_step and result["exit"] in (0, "timeout")  # once, it did not exit after its last step
    result["stopped_after_last_step"] = every_step and result["exit"] == "timeout"
    if args.profile_step:
        result["profile"] = trace_summary(workdir / "verl_profile")
    return result


def verl_row(record: dict) -> dict:
    """One step's figures under the names the hybridrl sides use."""
    m = record["data"]

    def total(*keys):
        values = [m[k] for k in keys if k in m]
        return sum(values) if values else None

    return {
        "step": record["step"],
        "step_s": m.get("timing_s/step"),
        "rollout_s": m.get("timing_s/gen"),
        "logprobs_s": total("timing_s/old_log_prob", "timing_s/ref", "timing_s/values"),
        "update_s": total("timing_s/update_actor", "timing_s/update_critic"),
        "update_actor_s": m.get("timing_s/update_actor"),
        "sync_s": m.get("timing_s/update_weights"),
        "reward": m.get("critic/score/mean"),
        "response_length": m.get("response_length/mean"),
        "prompt_length": m.get("prompt_length/mean"),
        "verl_mfu": m.get("perf/mfu/actor"),
        "verl_peak_gib": m.get("perf/max_memory_allocated_gb"),
        "timing": {k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("timing_s/")},
    }


# -- hybridrl: gpu_vs_trl.py's sides ---------------------------------------------------------


def run_hybridrl(args, side: str, model: str, workdir: Path) -> dict:
    result_file = workdir / f"{side}.json"
    result_file.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).with_name("gpu_vs_trl.py")), "--side", side,
           "--result", str(result_file), "--model", model, "--workdir", str(workdir)]  # fmt: skip
    for key in ("algorithm", "prompts", "n", "max_tokens", "lr", "warmup", "steps", "gpu_memory_utilization",
                "lengths", "trainer_options"):  # fmt: skip
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    cmd += ["--vllm-options", args.vllm_options] if side == "hybridrl-vllm" else ["--engine-options", args.hf_options]
    cmd += ["--sharding", args.sharding]
    try:
        code = subprocess.run(cmd, timeout=args.side_timeout).returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    result = json.loads(result_file.read_text()) if result_file.is_file() else {"side": side, "steps": []}
    return result | {"exit": code}


# -- measuring and reporting ----------------------------------------------------------------


class GpuMemory:
    """The GPU's memory in use by all processes and its utilisation, from nvidia-smi every 0.5 s:
    the peak, and the samples (seconds from the start, MiB, percent busy) to see idle phases."""

    def __enter__(self):
        self.peak_mib, self.samples, self.done = 0, [], threading.Event()
        self.start = time.perf_counter()
        self.thread = threading.Thread(target=self.poll, daemon=True)
        self.thread.start()
        return self

    def poll(self):
        query = ["nvidia-smi", "--query-gpu=memory.used,utilization.gpu", "--format=csv,noheader,nounits"]
        while not self.done.wait(0.5):
            try:
                used, busy = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout.split(",")[:2]
            except (OSError, ValueError, subprocess.SubprocessError):
                return
            self.samples.append((round(time.perf_counter() - self.start, 1), int(used), int(busy)))
            self.peak_mib = max(self.peak_mib, int(used))

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()


def update_mfu(model: str, rows: int, response_length: float, update_s: float, peak: float | None) -> float | None:
    """The MFU of an update over ``rows`` sequences of 128 prompt tokens and ``response_length``
    response tokens (the mean, for verl, which logs no lengths per row), its FLOPs counted as the
    trainer counts its own (common.matmul_flops), against ``peak`` (FLOP/s)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not peak or not update_s:
        return None
    import torch

    with torch.device("meta"):
        policy = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    length = round(common.PROMPT_CHARS + response_length)
    flops = 3 * common.matmul_flops(policy, [length] * rows, round(rows * response_length))
    return flops / update_s / peak


def verl_update_mfu(R: dict, args, model: str, workdir: Path) -> None:
    """verl's update MFU counted as hybridrl counts its own, against the peak the trainer's MFU uses:
    read from the hybridrl sides' logged metrics (update TFLOP/s over MFU), else from one step of a
    tiny run."""
    verl = R["sides"].get("verl", {}).get("summary")
    if not verl or not verl.get("response_length"):
        return
    ours = [row for side, r in R["sides"].items() if side != "verl" for row in r.get("steps", [])]
    peak = common.peak_from_metrics(ours)
    if peak is None:
        common.use_checkout("algo_grpo")
        peak = common.trainer_peak_flops(workdir)
    timed = [r["update_actor_s"] for r in R["sides"]["verl"]["steps"][args.warmup :] if r.get("update_actor_s")]
    if timed:
        update_s = statistics.median(timed)
        verl["update_mfu"] = update_mfu(model, args.prompts * args.n, verl["response_length"], update_s, peak)


def summarize(side: dict, args) -> dict:
    timed = side.get("steps", [])[args.warmup :]
    if not timed:
        return {}

    def med(key):
        values = [r[key] for r in timed if r.get(key) is not None]
        return statistics.median(values) if values else None

    out = {"timed_steps": len(timed), "step_s": med("step_s"), "max_step_s": max(r["step_s"] for r in timed)}
    for key in ("rollout_s", "logprobs_s", "update_s", "sync_s", "response_length", "reward", "verl_mfu",
                "update_mfu", "rollout_tokens_per_s"):  # fmt: skip
        if med(key) is not None:
            out[key] = med(key)
    out["gpu_peak_gib"] = side.get("gpu_peak_gib")
    return out


COLUMNS = [
    ("side", None, "{:<14}"),
    ("step s", "step_s", "{:>7.3f}"),
    ("max s", "max_step_s", "{:>6.2f}"),
    ("rollout s", "rollout_s", "{:>9.3f}"),
    ("logprobs s", "logprobs_s", "{:>10.3f}"),
    ("update s", "update_s", "{:>8.3f}"),
    ("MFU", "update_mfu", "{:>6.1%}"),
    ("verl MFU", "verl_mfu", "{:>8.1%}"),
    ("sync s", "sync_s", "{:>6.3f}"),
    ("resp len", "response_length", "{:>8.1f}"),
    ("GPU peak GiB", "gpu_peak_gib", "{:>12.1f}"),
]


def main(args) -> int:
    import torch

    out = common.out_path(args.out, "vs_verl_gpu.json")
    workdir = Path(args.workdir_abs)
    workdir.mkdir(parents=True, exist_ok=True)
    rate = 0.0 if args.lengths == "fixed" else 4 / args.max_tokens
    name = "qwen2.5-0.5b-shaped-content-template" + (f"-end-rate-{rate:.4g}" if rate else "")
    model = common.build_model(workdir / name, common.QWEN05, chat_template=TEMPLATE, end_rate=rate)
    R = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine() + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""),
        "config": vars(args) | {"model": model},
        "sides": {},
    }
    for side in args.sides.split(","):
        if side not in SIDES:
            raise SystemExit(f"unknown side '{side}'; choose from {', '.join(SIDES)}")
        start = time.perf_counter()
        with GpuMemory() as memory:
            result = run_verl(args, model, workdir) if side == "verl" else run_hybridrl(args, side, model, workdir)
        result |= {
            "wall_s": round(time.perf_counter() - start, 1),
            "gpu_peak_gib": round(memory.peak_mib / 1024, 1),
            "gpu_samples": memory.samples,
        }
        result["summary"] = summarize(result, args)
        R["sides"][side] = result
        R["summary"] = {k: v["summary"] for k, v in R["sides"].items() if v["summary"]}
        s = {k: v["step_s"] for k, v in R["summary"].items()}
        R["ratios"] = {f"verl_over_{k}": s["verl"] / v for k, v in s.items() if k != "verl" and "verl" in s}
        common.write_json(R, out)
    verl_update_mfu(R, args, model, workdir)  # once every side has run: the hybridrl sides give the peak
    common.write_json(R, out)
    common.print_sides(R, COLUMNS, out)
    return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, from {', '.join(SIDES)}")
    p.add_argument("--algorithm", choices=["grpo", "ppo"], default="grpo")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--lengths", choices=["fixed", "long-tail"], default="fixed")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=None, help="default 1e-6, 1e-9 with long-tail lengths")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vLLM's share on every side")
    p.add_argument("--verl-options", default="", help="more hydra overrides for verl, space-separated")
    p.add_argument("--vllm-options", default="{}", help="JSON of hybridrl-vllm's rollout options")
    p.add_argument("--hf-options", default='{"compile": "auto"}', help="JSON of hybridrl-hf's rollout options")
    p.add_argument("--trainer-options", default="{}", help="JSON of extra hybridrl trainer options")
    p.add_argument("--sharding", default='{"compile": "auto"}', help="JSON of hybridrl's sharding options (single)")
    p.add_argument(
        "--profile-step",
        type=int,
        default=0,
        help="verl: take a torch profile of this step, "
        "summarised into the JSON (its step times are inflated: time another run)",
    )
    p.add_argument("--side-timeout", type=float, default=540)
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.lr is None:
        args.lr = 1e-9 if args.lengths == "long-tail" else 1e-6
    args.workdir_abs = str(Path(args.workdir or Path(tempfile.gettempdir()) / "hybridrl-vs-verl").absolute())
    return args


if __name__ == "__main__":
    sys.exit(main(parse_args()))
