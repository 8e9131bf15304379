#!/usr/bin/env python3
"""GRPO steps with ``rollout.engine: sglang`` (in-process ``sglang.Engine``) on one GPU.

Measures, per step: rollout tokens/s, the in-place weight sync (update_weights_from_tensor),
the GPU memory released around training and the time to release/resume it, and the
train/inference logprob mismatch (``rollout/logprob_diff_*``). Prints a table and writes
JSON (``--out``; default ``$OUT/sglang_grpo.json`` when ``OUT`` is set, else
``./sglang_grpo.json``); partial results are written if a stage fails.

Needs a CUDA GPU with sglang 0.5.x (which brings its own torch), pydantic and pyyaml, and
hybridrl with the grpo and sglang plugins: installed (``pip install -e . -e plugins/algo_grpo
-e plugins/rollout_sglang``), or run from a checkout, in which case the script puts ``core/``
and ``plugins/*/`` on ``sys.path`` and registers the plugins itself. Nothing is downloaded:

    python benchmarks/gpu_sglang_grpo.py                 # 4 steps, 64 prompts x 8 samples x 256 tokens
    python benchmarks/gpu_sglang_grpo.py --smoke         # CPU check of the script itself (hf engine)

The model is Qwen2.5-0.5B-shaped (Qwen2ForCausalLM, 24 layers, hidden 896, vocabulary
151,936) with random weights built from its config, saved once under ``--workdir`` with the
byte-level tokenizer of common.py (one token a byte, ChatML specials and template); the reward
is the fraction of even token ids in a response, which a random model can learn. The policy
trains in float32 on the GPU beside the engine, which runs bfloat16 with the memory saver:
sleep() releases the weights, KV cache and CUDA graphs, the update resumes the weights and
loads the new ones over CUDA IPC, wake_up() resumes the KV cache and CUDA graphs.
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

for key, value in {
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}.items():
    os.environ.setdefault(key, value)

# --smoke runs the hf engine, so heads of 16 will do
TINY = dict(common.TINY, vocab_size=512, hidden_size=64, intermediate_size=128)
R: dict = {"errors": [], "steps": []}


def out_path(args) -> Path:
    return common.out_path(args.out, "sglang_grpo.json")


def dump(args) -> None:
    common.write_json(R, out_path(args))


# -- the model ---------------------------------------------------------------------------------


def build_model(folder: Path, cfg_kwargs: dict, device: str) -> str:
    """A Qwen2ForCausalLM with random weights, initialised on ``device``, with rope theta 1e6 and the
    byte-level tokenizer of common.py, saved once."""
    if (folder / "READY").is_file():
        return str(folder)
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab = common.save_tokenizer(folder, cfg_kwargs["vocab_size"], common.CHATML)
    cfg = Qwen2Config(**cfg_kwargs, eos_token_id=vocab["<|im_end|>"], pad_token_id=vocab["<|endoftext|>"],
                      bos_token_id=None)  # fmt: skip
    try:
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": 1000000.0}
    except Exception:
        cfg.rope_theta = 1000000.0
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    model = model.to(torch.bfloat16)
    model.config.torch_dtype = torch.bfloat16
    try:
        model.config.dtype = torch.bfloat16
    except Exception:
        pass
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "READY").write_text("ok")
    return str(folder)


# -- the measurements ------------------------------------------------------------------------------


def instrument(engine, record: dict, cuda: bool) -> None:
    """Wrap the engine's methods to time them and to read the GPU's free memory around sleep()."""
    import torch

    def free_gib():
        if not cuda:
            return 0.0
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0] / 2**30

    def wrap(name, before=None, after=None):
        method = getattr(engine, name)

        def run(*args, **kwargs):
            if before:
                before()
            start = time.perf_counter()
            result = method(*args, **kwargs)
            if cuda:
                torch.cuda.synchronize()
            record[f"{name}_s"] = record.get(f"{name}_s", 0.0) + time.perf_counter() - start
            if after:
                after(result)
            return result

        setattr(engine, name, run)

    def before_sleep():
        record["free_before_sleep_gib"] = free_gib()

    def after_sleep(_):
        record["free_after_sleep_gib"] = free_gib()
        record["released_gib"] = record["free_after_sleep_gib"] - record["free_before_sleep_gib"]

    def after_generate(out):
        record["generated_tokens"] = sum(len(t) for t in out.token_ids)

    def after_wake(_):
        record["free_after_wake_gib"] = free_gib()

    wrap("sleep", before_sleep, after_sleep)
    wrap("wake_up", None, after_wake)
    wrap("generate", None, after_generate)
    wrap("update_weights")


# -- the run ----------------------------------------------------------------------------------------


def config(args, model_dir: str, workdir: Path) -> dict:
    # every response is exactly max_tokens long, so tokens/s compare across engines and runs
    rollout = {"engine": "hf", "n": args.n, "max_tokens": args.max_tokens, "temperature": 1.0, "ignore_eos": True}
    if not args.smoke:
        rollout = {
            **rollout,
            "engine": "sglang",
            "mem_fraction_static": args.mem_fraction_static,
            "dtype": "bfloat16",
            "context_length": 1024,
            "enable_memory_saver": True,
            "release_weights": True,
            "log_level": "info",
            "engine_kwargs": json.loads(args.engine_kwargs),  # CUDA graphs: sized by the plugin to the batch
        }
        if args.attention_backend:
            rollout["attention_backend"] = args.attention_backend
    return {
        "model": {"path": model_dir, "dtype": args.policy_dtype},
        "data": {"source": "bench_sums", "size": 4096},
        "rollout": rollout,
        "rewards": [{"function": "even_tokens"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.0},
        "trainer": {
            "steps": args.steps,
            "prompts_per_step": args.prompts,
            "micro_batch_size": args.micro_batch,
            "lr": args.lr,
            "seed": 0,
            "device": "cpu" if args.smoke else "cuda",
            "run_dir": str(workdir / "run"),
            "sample_every": 0,
        },
        "logging": {"loggers": []},
    }


KEEP = common.GRPO_KEEP + ("response_length/mean",)


def main(args) -> None:
    t0 = time.perf_counter()
    import torch

    cuda = not args.smoke
    common.start_grpo(R, "gpu_sglang_grpo", cuda, ("algo_grpo", "rollout_sglang"), engine="sglang" if cuda else None)
    workdir = Path(args.workdir or Path(tempfile.gettempdir()) / "hybridrl-bench-sglang").absolute()
    t = time.perf_counter()
    model_dir = build_model(workdir / ("tiny" if args.smoke else "qwen2.5-0.5b-shaped"),
                            TINY if args.smoke else common.QWEN05, "cuda" if cuda else "cpu")  # fmt: skip
    R["build_model_s"] = round(time.perf_counter() - t, 2)
    trainer = common.build_trainer(R, config(args, model_dir, workdir), "bench-sglang")
    if cuda:
        R["free_after_setup_gib"] = round(torch.cuda.mem_get_info()[0] / 2**30, 2)
    dump(args)

    def before(step: int, record: dict) -> None:
        instrument(trainer.run.engine, record, cuda)

    def after(step: int, record: dict) -> None:
        if record.get("generate_s"):
            record["generate_tokens_per_s"] = record["generated_tokens"] / record["generate_s"]
        for name in ("sleep", "wake_up", "generate", "update_weights"):  # unwrap for the next step
            trainer.run.engine.__dict__.pop(name, None)

    def close() -> None:  # the trainer, the engine with it: its time
        t = time.perf_counter()
        trainer.close()
        R["close_s"] = round(time.perf_counter() - t, 2)

    common.run_steps(trainer, args.steps, KEEP, R, out_path(args), COLUMNS, before, after, close)
    R["summary"] = summarize(R["steps"])
    R["total_s"] = round(time.perf_counter() - t0, 1)
    R["ok"] = True


def summarize(steps: list[dict]) -> dict:
    """Medians over the steps after the first (which warms up kernels), and the extremes."""
    later = steps[1:] or steps
    return common.grpo_summary(
        steps,
        generate_tokens_per_s=common.median(later, "generate_tokens_per_s"),
        sleep_s=common.median(later, "sleep_s"),
        wake_up_s=common.median(later, "wake_up_s"),
        released_gib=common.median(later, "released_gib"),
    )


COLUMNS = [
    ("step", "step", "{:>4}"),
    ("reward", "reward/mean", "{:>7.4f}"),
    ("rollout tok/s", "throughput/rollout_tokens_per_s", "{:>13,.0f}"),
    ("gen tok/s", "generate_tokens_per_s", "{:>10,.0f}"),
    ("sync s", "timing/sync", "{:>7.3f}"),
    ("sleep s", "sleep_s", "{:>7.3f}"),
    ("freed GiB", "released_gib", "{:>9.1f}"),
    ("wake s", "wake_up_s", "{:>7.3f}"),
    ("lp diff mean", "rollout/logprob_diff_mean", "{:>12.5f}"),
    ("lp diff max", "rollout/logprob_diff_max", "{:>11.4f}"),
    ("step s", "timing/step", "{:>7.2f}"),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=64, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=16, help="responses per forward/backward")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--policy-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--mem-fraction-static", type=float, default=0.5)
    p.add_argument("--attention-backend", default=None, help="e.g. triton, if the default fails")
    p.add_argument("--engine-kwargs", default="{}", help="JSON of extra sglang.Engine arguments")
    p.add_argument("--workdir", default=None, help="where the model and the run go (default: the temp dir)")
    p.add_argument("--out", default=None, help="JSON file (default: $OUT/sglang_grpo.json or ./sglang_grpo.json)")
    p.add_argument("--smoke", action="store_true", help="CPU check of the script: tiny model, hf engine")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.prompts, args.n, args.max_tokens, args.micro_batch = 2, 4, 4, 16, 8
    return args


if __name__ == "__main__":  # SGLang spawns its scheduler processes, which re-import this file
    args = parse_args()
    common.run_and_exit(main, args, R, out_path(args))  # os._exit: not waiting on SGLang's children
