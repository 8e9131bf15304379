#!/usr/bin/env python3
"""GRPO steps of a 7B-shaped model on one GPU: LoRA (``model.lora``) or full fine-tuning.

    python benchmarks/gpu_lora.py --mode lora                 # adapters r 16 on every linear layer
    python benchmarks/gpu_lora.py --mode lora --r 32 --sync merged   # the merged weights each sync
    python benchmarks/gpu_lora.py --mode lora --r 32 --quantize 4bit   # over a 4-bit base (QLoRA)
    python benchmarks/gpu_lora.py --mode full                 # the same run training every weight
    python benchmarks/gpu_lora.py --mode full --kl 0 --sharding '{"activation_checkpointing": true}'
    python benchmarks/gpu_lora.py --smoke --mode lora         # CPU check of the script (tiny model)

The model is Qwen2.5-7B-shaped (Qwen2ForCausalLM: 28 layers, hidden 3584, 28 heads of 128 with 4
KV heads, MLP 18944, vocabulary 152,064, untied embeddings; 7.6B parameters) with random weights,
built on the GPU from its config and saved once in bfloat16 under ``--workdir`` (nothing
downloaded). The policy trains with float32 master weights and bf16 autocast (the defaults), the
``hf`` engine generates from its bf16 copy; the reward is the fraction of even token ids
(benchmarks/common.py). GRPO with KL k3 to the reference (``--kl``, default 0.04): with LoRA the
reference is the base model with the adapters off, without LoRA a second model. Each mode runs
in its own process; an out-of-memory failure is a result (recorded with the stage and the memory
in use), not a crash. ``--engine vllm``: an in-process vLLM engine (bf16, sleep level 1) instead
of hf. ``--sync``: what each sync sends (``model.lora.sync``; auto on a GPU: the adapter alone).
``--quantize 4bit|8bit``: the frozen base through bitsandbytes (``model.lora.quantize``; the hf
engine, the adapter alone each sync).
Per step: step, rollout, update and weight-sync seconds and the peak GPU memory; after setup the
memory the models hold. Writes ``$OUT/lora_<mode>_<engine>[_<sync>].json``.
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
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

QWEN7B = dict(
    common.QWEN05,
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    max_window_layers=28,
    tie_word_embeddings=False,
)
VLLM = {  # in-process vLLM beside the policy: bf16, its memory released around training
    "dtype": "bfloat16",
    "max_model_len": 1024,
    "gpu_memory_utilization": 0.3,
    "sleep_level": 1,
    "engine_kwargs": {"skip_tokenizer_init": True},
}
R: dict = {"errors": [], "steps": []}


def out_path(args) -> Path:
    sync = f"_{args.sync}" if args.mode == "lora" and args.sync != "auto" else ""
    quantized = f"_{args.quantize}" if args.quantize != "none" else ""
    return common.out_path(args.out, f"lora_{args.mode}_{args.engine}{sync}{quantized}.json")


def build_model(folder: Path, shape: dict, cuda: bool) -> str:
    """common.build_model, with the random weights made on the GPU (a 7B model's init on the
    CPU takes minutes)."""
    if (folder / "READY").is_file():
        return str(folder)
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab = common.save_tokenizer(folder, shape["vocab_size"], common.CHATML)
    cfg = Qwen2Config(**shape, eos_token_id=vocab["<|im_end|>"], pad_token_id=vocab["<|endoftext|>"])
    torch.manual_seed(0)
    with torch.device("cuda" if cuda else "cpu"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    del model
    if cuda:
        torch.cuda.empty_cache()
    (folder / "READY").write_text("ok")
    return str(folder)


def config(args, model_dir: str, workdir: Path) -> dict:
    model = {"path": model_dir}
    if args.mode == "lora":
        model["lora"] = {"r": args.r, "alpha": 2 * args.r, "target_modules": "all-linear", "sync": args.sync}
        model["lora"]["quantize"] = args.quantize
    return {
        "model": model,
        "data": {"source": "bench_sums", "size": 4096},
        "rollout": {"engine": args.engine, "n": args.n, "max_tokens": args.max_tokens, "ignore_eos": True}
        | (VLLM if args.engine == "vllm" else {})
        | json.loads(args.engine_options or "{}"),
        "rewards": [{"function": "even_tokens"}],
        "algorithm": {"name": "grpo", "kl_coef": args.kl},
        "sharding": json.loads(args.sharding),
        "trainer": {
            "steps": args.steps,
            "prompts_per_step": args.prompts,
            "micro_batch_size": args.micro_batch,
            "lr": args.lr or (1e-4 if args.mode == "lora" else 1e-6),
            "seed": 0,
            "device": "cpu" if args.smoke else "cuda",
            "run_dir": str(workdir / f"run-{args.mode}-{int(time.time())}"),
            "sample_every": 0,
            "save_every": 0,
        },
        "logging": {"loggers": []},
    }


def gib(n: int) -> float:
    return round(n / 2**30, 2)


def out_of_memory(e: BaseException) -> bool:
    import torch

    while e is not None:
        if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower():
            return True
        e = e.__cause__
    return False


KEEP = ("reward/mean", "timing/rollout", "timing/logprobs", "timing/update", "timing/sync", "timing/step")
KEEP += ("rollout/logprob_diff_mean", "rollout/logprob_diff_max", "vllm/wake_weights_s")
COLUMNS = [
    ("step", "step", "{:>4}"),
    ("reward", "reward/mean", "{:>7.4f}"),
    ("rollout s", "timing/rollout", "{:>9.2f}"),
    ("update s", "timing/update", "{:>8.2f}"),
    ("sync s", "timing/sync", "{:>7.3f}"),
    ("step s", "timing/step", "{:>7.2f}"),
    ("peak GiB", "peak_gib", "{:>8.1f}"),
]


def main(args) -> None:
    import torch

    cuda = not args.smoke
    plugins = ("algo_grpo", "rollout_vllm") if args.engine == "vllm" else ("algo_grpo",)
    common.start_grpo(R, "gpu_lora", cuda, plugins, engine="peft")
    R["mode"], R["shape"], R["sync"] = args.mode, "tiny" if args.smoke else "qwen2.5-7b", args.sync
    R["quantize"] = args.quantize
    workdir = Path(args.workdir or Path(tempfile.gettempdir()) / "hybridrl-bench-lora").absolute()
    t = time.perf_counter()
    model_dir = build_model(workdir / R["shape"], common.TINY if args.smoke else QWEN7B, cuda)
    R["build_model_s"] = round(time.perf_counter() - t, 1)
    if cuda:
        R["gpu_total_gib"] = gib(torch.cuda.mem_get_info()[1])
        torch.cuda.reset_peak_memory_stats()
    stage = "setup"
    try:
        trainer = common.build_trainer(R, config(args, model_dir, workdir), f"bench-lora-{args.mode}")
        R["trained_parameters"] = sum(p.numel() for p in trainer.run.policy.parameters() if p.requires_grad)
        R["parameters"] = sum(p.numel() for p in trainer.run.policy.parameters())
        if cuda:
            R["allocated_after_setup_gib"] = gib(torch.cuda.memory_allocated())

        def before(step: int, record: dict) -> None:
            nonlocal stage
            stage = f"step {step}"
            if cuda:
                torch.cuda.reset_peak_memory_stats()

        def after(step: int, record: dict) -> None:
            if cuda:
                record["peak_gib"] = gib(torch.cuda.max_memory_allocated())

        common.run_steps(trainer, args.steps, KEEP, R, out_path(args), COLUMNS, before, after)
    except BaseException as e:  # noqa: BLE001 - an out-of-memory failure is the result for full fine-tuning
        if not out_of_memory(e):
            raise
        R["out_of_memory"] = {
            "stage": stage,
            "error": str(e).splitlines()[0][:600],
            "allocated_gib": gib(torch.cuda.memory_allocated()) if cuda else None,
            "peak_gib": gib(torch.cuda.max_memory_allocated()) if cuda else None,
        }
        print(f"out of memory in {stage}: {R['out_of_memory']['error']}", flush=True)
    later = R["steps"][1:] or R["steps"]
    R["summary"] = {
        "mode": args.mode,
        "sync": args.sync if args.mode == "lora" else None,
        "quantize": args.quantize,
        "trained_parameters": R.get("trained_parameters"),
        "allocated_after_setup_gib": R.get("allocated_after_setup_gib"),
        "out_of_memory": R.get("out_of_memory"),
        "steps": len(R["steps"]),
        **{k.split("/")[-1] + "_s": common.median(later, k) for k in KEEP[1:6]},
        "logprob_diff_mean": common.median(later, "rollout/logprob_diff_mean"),
        "wake_weights_s": common.median(later, "vllm/wake_weights_s"),  # vLLM, sleep level 1: part of sync_s
        "logprob_diff_max": max((s.get("rollout/logprob_diff_max", 0.0) for s in R["steps"]), default=None),
        "peak_gib": max((s["peak_gib"] for s in R["steps"] if "peak_gib" in s), default=None),
        "reward_first": R["steps"][0]["reward/mean"] if R["steps"] else None,
        "reward_last": R["steps"][-1]["reward/mean"] if R["steps"] else None,
    }
    R["ok"] = True


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("lora", "full"), required=True)
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="rollout engine")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8, help="responses per forward/backward")
    p.add_argument("--r", type=int, default=16, help="LoRA rank (alpha is 2r)")
    p.add_argument("--engine-options", default=None, help='JSON of engine options, e.g. {"fuse_projections": false}')
    p.add_argument("--sync", choices=("auto", "adapter", "merged"), default="auto", help="model.lora.sync")
    p.add_argument("--quantize", choices=("none", "4bit", "8bit"), default="none", help="model.lora.quantize")
    p.add_argument("--kl", type=float, default=0.04, help="algorithm.kl_coef (0: no reference model)")
    p.add_argument("--lr", type=float, default=None, help="default: 1e-4 with LoRA, 1e-6 without")
    p.add_argument("--sharding", default="{}", help="JSON of sharding options")
    p.add_argument("--workdir", default=None, help="where the model and the runs go (default: the temp dir)")
    p.add_argument("--out", default=None, help="JSON file (default: $OUT/lora_<mode>.json)")
    p.add_argument("--smoke", action="store_true", help="CPU check of the script: tiny model")
    args = p.parse_args(argv)
    if args.smoke:
        args.prompts, args.n, args.max_tokens, args.micro_batch, args.steps = 2, 4, 8, 4, min(args.steps, 2)
    return args


if __name__ == "__main__":
    args = parse_args()
    common.run_and_exit(main, args, R, out_path(args))
