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
151,936) with random weights built from its config, saved once under ``--workdir`` with a
byte-level BPE tokenizer (256 byte tokens and ChatML specials); the reward is the fraction
of even token ids in a response, which a random model can learn. The policy trains in
float32 on the GPU beside the engine, which runs bfloat16 with the memory saver: sleep()
releases the weights, KV cache and CUDA graphs, the update resumes the weights and loads the
new ones over CUDA IPC, wake_up() resumes the KV cache and CUDA graphs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

for key, value in {
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}.items():
    os.environ.setdefault(key, value)

ROOT = Path(__file__).resolve().parent.parent
QWEN05 = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    hidden_act="silu",
    use_sliding_window=False,
    max_window_layers=24,
    attention_dropout=0.0,
    initializer_range=0.02,
)
TINY = dict(QWEN05, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, max_window_layers=2)  # fmt: skip
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 256, 257, 258 after the 256 bytes
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
R: dict = {"errors": [], "steps": []}


def out_path(args) -> Path:
    if args.out:
        return Path(args.out)
    return Path(os.environ["OUT"]) / "sglang_grpo.json" if os.environ.get("OUT") else Path("sglang_grpo.json")


def dump(args) -> None:
    path = out_path(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(R, indent=1, default=str) + "\n")


def import_hybridrl():
    """hybridrl and its two plugins, from the installed packages or from this checkout."""
    try:
        import hybridrl_algo_grpo  # noqa: F401
        import hybridrl_rollout_sglang  # noqa: F401

        import hybridrl  # noqa: F401
    except ImportError:
        for sub in ("core", "plugins/algo_grpo", "plugins/rollout_sglang"):
            sys.path.insert(0, str(ROOT / sub))
    try:
        import pydantic  # noqa: F401
        import yaml  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"gpu_sglang_grpo: hybridrl needs {e.name}: pip install pydantic pyyaml") from None
    import hybridrl_algo_grpo
    import hybridrl_rollout_sglang

    from hybridrl import plugins

    pm = plugins.get_plugin_manager()
    for name, module in (("grpo", hybridrl_algo_grpo), ("sglang", hybridrl_rollout_sglang)):
        if not pm.is_registered(module) and not pm.has_plugin(name):
            pm.register(module, name=name)
    pm.register(bench_plugin(), name="bench")
    plugins.invalidate_registry()


# -- the model ---------------------------------------------------------------------------------


def build_model(folder: Path, cfg_kwargs: dict, device: str) -> str:
    """A Qwen2ForCausalLM with random weights and a byte-level BPE tokenizer, saved once."""
    if (folder / "READY").is_file():
        return str(folder)
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None, chat_template=CHATML
    ).save_pretrained(folder)

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


# -- the task: prompts, a learnable reward, and the measurements --------------------------------------


def bench_classes():
    from pydantic import Field

    from hybridrl.components import Options as BaseOptions
    from hybridrl.components import PromptSource, RewardFunction

    class Sums(PromptSource):
        class Options(BaseOptions):
            size: int = Field(4096, gt=0, description="Rows.")

        def __len__(self):
            return self.options.size

        def __getitem__(self, i):
            a, b = (i * 7919) % 1000, (i * 104729) % 1000
            return {"question": f"What is {a} + {b}? Think step by step.", "answer": str(a + b)}

    class EvenTokens(RewardFunction):
        """Fraction of even token ids in the response: about 0.5 at random, learnable."""

        def score(self, batch):
            mask = batch["response_mask"].float()
            even = (batch["responses"] % 2 == 0).float() * mask
            return (even.sum(-1) / mask.sum(-1).clamp(min=1)).tolist()

    return Sums, EvenTokens


def bench_plugin():
    """The prompt source and the reward above, registered through the hooks like any plugin."""
    from hybridrl.hookspecs import hookimpl

    sums, even_tokens = bench_classes()

    class BenchPlugin:
        @hookimpl
        def register_datasets(self, register):
            register("bench_sums", sums)

        @hookimpl
        def register_reward_functions(self, register):
            register("even_tokens", even_tokens)

    return BenchPlugin()


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
            "engine_kwargs": {"cuda_graph_max_bs_decode": 256, **json.loads(args.engine_kwargs)},
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


KEEP = (
    "reward/mean",
    "throughput/rollout_tokens_per_s",
    "timing/rollout",
    "timing/update",
    "timing/sync",
    "timing/step",
    "rollout/logprob_diff_mean",
    "rollout/logprob_diff_max",
    "response_length/mean",
)


def main(args) -> None:
    t0 = time.perf_counter()
    import torch

    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        raise SystemExit("gpu_sglang_grpo: no CUDA GPU visible; --smoke runs the CPU check of the script.")
    import_hybridrl()
    import transformers

    from hybridrl.config import load_config
    from hybridrl.trainer import Trainer

    R["versions"] = {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__}  # fmt: skip
    if cuda:
        import sglang

        R["versions"]["sglang"] = sglang.__version__
        R["gpu"] = torch.cuda.get_device_name(0)
    workdir = Path(args.workdir or Path(tempfile.gettempdir()) / "hybridrl-bench-sglang").absolute()
    t = time.perf_counter()
    model_dir = build_model(workdir / ("tiny" if args.smoke else "qwen2.5-0.5b-shaped"),
                            TINY if args.smoke else QWEN05, "cuda" if cuda else "cpu")  # fmt: skip
    R["build_model_s"] = round(time.perf_counter() - t, 2)
    cfg = config(args, model_dir, workdir)
    R["config"] = cfg
    trainer = Trainer(load_config(data=cfg), name="bench-sglang")
    t = time.perf_counter()
    trainer.setup()  # loads the policy, starts the engine
    R["setup_s"] = round(time.perf_counter() - t, 2)
    if cuda:
        R["free_after_setup_gib"] = round(torch.cuda.mem_get_info()[0] / 2**30, 2)
    dump(args)
    for logger in trainer.loggers:  # as Trainer.train does (its checkpoint at the end is not wanted here)
        logger.open(args.steps, 0)
    try:
        for step in range(1, args.steps + 1):
            record: dict = {"step": step}
            instrument(trainer.engine, record, cuda)
            metrics = trainer.step(step)
            for k in KEEP:
                if k in metrics:
                    record[k] = metrics[k]
            if record.get("generate_s"):
                record["generate_tokens_per_s"] = record["generated_tokens"] / record["generate_s"]
            R["steps"].append({k: round(v, 5) if isinstance(v, float) else v for k, v in record.items()})
            for name in ("sleep", "wake_up", "generate", "update_weights"):  # unwrap for the next step
                trainer.engine.__dict__.pop(name, None)
            dump(args)
            print_row(R["steps"][-1])
    finally:
        for logger in trainer.loggers:
            logger.close()
        t = time.perf_counter()
        trainer.engine.close()
        R["close_s"] = round(time.perf_counter() - t, 2)
    R["summary"] = summarize(R["steps"])
    R["total_s"] = round(time.perf_counter() - t0, 1)
    R["ok"] = True


def summarize(steps: list[dict]) -> dict:
    """Medians over the steps after the first (which warms up kernels), and the extremes."""
    later = steps[1:] or steps
    med = lambda k: round(statistics.median(s[k] for s in later if k in s), 4) if any(k in s for s in later) else None  # noqa: E731
    return {
        "steps_in_median": len(later),
        "rollout_tokens_per_s": med("throughput/rollout_tokens_per_s"),
        "generate_tokens_per_s": med("generate_tokens_per_s"),
        "weight_sync_s": med("timing/sync"),
        "sleep_s": med("sleep_s"),
        "wake_up_s": med("wake_up_s"),
        "released_gib": med("released_gib"),
        "logprob_diff_mean": med("rollout/logprob_diff_mean"),
        "logprob_diff_max": max((s.get("rollout/logprob_diff_max", 0.0) for s in steps), default=None),
        "step_s": med("timing/step"),
        "reward_first": steps[0].get("reward/mean") if steps else None,
        "reward_last": steps[-1].get("reward/mean") if steps else None,
    }


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


def print_row(row: dict) -> None:
    if row["step"] == 1:
        print(" | ".join(name for name, _, _ in COLUMNS), flush=True)
    cells = []
    for name, key, fmt in COLUMNS:
        value = row.get(key)
        cells.append(fmt.format(value) if value is not None else f"{'-':>{len(name)}}")
    print(" | ".join(cells), flush=True)


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
    R["started"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    R["argv"] = sys.argv[1:]
    code = 0
    try:
        main(args)
    except BaseException as e:  # noqa: BLE001 - record what failed, then exit non-zero
        R["ok"] = False
        R["errors"].append({"error": repr(e)[:2000], "traceback": traceback.format_exc()[-4000:]})
        traceback.print_exc()
        code = 1
    dump(args)
    print("RESULT_JSON " + json.dumps(R.get("summary"), default=str), flush=True)
    print(f"wrote {out_path(args)}", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # do not wait on SGLang's child processes at interpreter exit
