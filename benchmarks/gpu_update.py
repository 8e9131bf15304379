#!/usr/bin/env python3
"""The update phase alone: seconds, training tokens/s and MFU of hybridrl's policy update on the
reference batch, for each way of running it.

    python benchmarks/gpu_update.py                  # every variant, on the GPU
    python benchmarks/gpu_update.py --smoke          # CPU check of the script (tiny model)
    python benchmarks/gpu_update.py --device cpu --model DIR --prompts 4 --max-tokens 48 \
        --only "fp32 (no autocast);fp32 + compile"   # another model, e.g. on the CPU

The batch is the reference configuration's (see gpu_vs_trl.py): 64 responses of 256 tokens
after prompts of 128, random token ids (the rollout engine ``bench_replay`` of common.py: no model,
the same ids every step), random scores, GRPO with KL k3 (beta 0.04) against a reference model.
Each variant is a fresh run (``build_run``) with other sharding or model options, driven by
``Trainer.step`` in a process of its own (``--in-process``: all in this one); ``--warmup`` steps,
then ``--steps`` timed ones. Its figures are the trainer's own metrics of each step: the update's
seconds (``timing/update``), the logprobs' (``timing/logprobs`` and ``timing/advantages``), training
tokens/s, TFLOP/s and MFU (``throughput/*``: the matrix multiplications of the forward and backward
passes against the GPU's dense bf16 peak). Writes ``$OUT/update_gpu.json``.

``--lengths long-tail`` gives each step new response lengths, geometric with a mean of about
max/4 and capped at ``--max-tokens`` (what a real run sees). Rows report the passes of an update (as
the run's pass runner plans them for the step's batch) and how many graphs torch.compile has built
by the end (a number that keeps growing means recompiles each step), and the tokens the passes ran
(packed rows where trainer.pack_sequences packs, else padded ones). ``--pass-costs`` is 'budget'
alone: the cost of a pass in the trainer's micro-batch cut is the planner's own, not a setting.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

VARIANTS = {
    # name: (model options, sharding options, the pass runner's head path on?[, trainer options])
    # trainer.pack_sequences is 'auto' unless set: packed passes on a GPU
    "fp32 (no autocast)": ({}, {"mixed_precision": "off"}, True),
    "bf16 autocast, full logits": ({}, {"mixed_precision": "bf16"}, False),
    "fp32 + compile": ({}, {"mixed_precision": "off", "compile": True}, True),
    "bf16 autocast": ({}, {"mixed_precision": "bf16"}, True),
    "bf16 autocast + activation ckpt": ({}, {"mixed_precision": "bf16", "activation_checkpointing": True}, True),
    "bf16 autocast + compile": ({}, {"mixed_precision": "bf16", "compile": True}, True),
    "bf16 autocast + compile, logits recomputed": (
        {},
        {"mixed_precision": "bf16", "compile": True, "keep_logits_gib": 0},
        True,
    ),
    "bf16 autocast + compile, full logits": ({}, {"mixed_precision": "bf16", "compile": True}, False),
    "bf16 autocast + compile, padded": (
        {},
        {"mixed_precision": "bf16", "compile": True},
        True,
        {"pack_sequences": False},
    ),
}


def compiled_graphs() -> int:
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except (ImportError, KeyError):
        return 0


def run_tokens(p, prompt, response) -> int:
    """Tokens the planned pass ``p`` runs: its packed rows (trainer.pack_sequences), else its padded
    ones (each row at the pass's longest prompt + longest response)."""
    if p.layout == "packed":
        return p.placement.tokens()
    return len(p.rows) * (max(prompt[i] for i in p.rows) + max(response[i] for i in p.rows))


def variant_config(args, model_dir: str, name: str, device) -> dict:
    """The run of a variant: the reference batch's sizes, its responses drawn without a model
    (``bench_replay``: random ids, the same every step, or long-tail lengths new each step) and scored
    at random (``random_scores``), GRPO with KL k3 against a reference."""
    model_opts, sharding, _, *trainer_opts = VARIANTS[name]
    return {
        "model": {"path": model_dir, "dtype": "float32", **model_opts},
        "data": {
            "source": "hf",
            "path": str(Path(args.workdir) / "prompts.jsonl"),
            "chat_template": False,
            "shuffle": False,
        },
        "rollout": {
            "engine": "bench_replay",
            "n": args.n,
            "max_tokens": args.max_tokens,
            "sync_check": 0,
            "response_lengths": args.lengths,
        },
        "rewards": [{"function": "random_scores"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.04, "kl_kind": "k3"},
        "sharding": {"strategy": "single", **sharding},
        "trainer": {
            "steps": args.warmup + args.steps,
            "prompts_per_step": args.prompts,
            "lr": 1e-6,
            "device": str(device),
            "sample_every": 0,
            "run_dir": str(Path(args.workdir) / f"run-{time.time_ns()}"),
            **(trainer_opts[0] if trainer_opts else {}),
        },  # fmt: skip
        "logging": {"loggers": []},
    }


def run_variant(args, model_dir: str, name: str, device) -> dict:
    """Warm-up and timed steps of a variant's run: each step's stage times and throughput as the
    trainer logs them (``timing/*``, ``throughput/*``), the passes its pass runner plans for the
    step's batch and the tokens they run."""
    import torch

    from hybridrl.batch import Batch
    from hybridrl.config import load_config
    from hybridrl.run import build_run
    from hybridrl.trainer import Trainer

    common.register_bench_plugin()
    trainer = Trainer(build_run(load_config(data=variant_config(args, model_dir, name, device)), name="bench-update"))
    run = trainer.run
    if not VARIANTS[name][2]:
        for model in filter(None, (run.policy, run.ref)):  # the plain path: (B, T, V) logits from the model
            run.passes.handle(model).plain_head()
    rows = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.open(args.warmup + args.steps)
    try:
        for step in range(1, args.warmup + args.steps + 1):
            m = trainer.step(step)
            prompts, out = run.engine.last  # the step's batch, as the trainer built it
            b = Batch.from_rollout(prompts, out, args.n, run.tokenizer.pad_token_id).to(run.ctx.device)
            groups = [part.planned for part in run.passes.parts(run.policy, b)]
            prompt, response = b["prompt_mask"].sum(-1).tolist(), b.response_lengths().tolist()
            rows.append({"logprobs_s": m["timing/logprobs"] + m.get("timing/advantages", 0.0),
                         "update_s": m["timing/update"],
                         **{k.split("/")[-1]: v for k, v in m.items() if k in THROUGHPUT},
                         "passes": len(groups), "padded_tokens": sum(run_tokens(p, prompt, response) for p in groups),
                         "graphs": compiled_graphs()})  # fmt: skip
            print(f"  [{name}] {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in rows[-1].items()), flush=True)
    finally:
        trainer.close()
    timed = rows[args.warmup :]
    res = {k: statistics.median(r[k] for r in timed) for k in timed[0]}
    res["steps"] = rows
    if device.type == "cuda":
        res["peak_alloc_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del trainer, run
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


THROUGHPUT = ("throughput/train_tokens_per_s", "throughput/update_tflops", "throughput/update_mfu")


def run_in_own_process(args, model_dir: str, variant: str) -> dict:
    """:func:`run_variant` in a new process: within one process, compiled blocks share
    torch.compile's cache and its limit of recompilations, so a variant run after another one
    starts from that one's graphs (a padded update measured 0.716 s after one form of packing and
    1.134 s after another, 1.320 s in a process of its own)."""
    import subprocess

    result = Path(args.workdir) / f"variant-{os.getpid()}.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--variant", variant, "--result", str(result), "--model", model_dir]
    for key in ("prompts", "n", "max_tokens", "warmup", "steps", "workdir", "lengths", "device", "threads"):
        if getattr(args, key) is not None:
            cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    cmd += ["--smoke"] if args.smoke else []
    code = subprocess.run(cmd).returncode
    if code or not result.is_file():
        raise RuntimeError(f"the process of variant '{variant}' exited with code {code}")
    return json.loads(result.read_text())


def main(args) -> int:
    import torch
    import transformers

    common.use_checkout("algo_grpo")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cpu" if args.smoke else "cuda"))
    out = Path(args.out) if args.out else Path(os.environ.get("OUT", ".")) / "update_gpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    args.workdir = str(Path(args.workdir or Path(tempfile.gettempdir()) / "hybridrl-vs-trl").absolute())
    shape = common.TINY if args.smoke else common.QWEN05
    model_dir = args.model or common.build_model(
        Path(args.workdir) / ("tiny" if args.smoke else "qwen2.5-0.5b-shaped"), shape
    )
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    (Path(args.workdir) / "prompts.jsonl").write_text(
        "".join(json.dumps({"question": common.prompt(i), "answer": "0"}) + "\n" for i in range(64))
    )
    R = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "batch": {
            "responses": args.prompts * args.n,
            "prompt_tokens": common.PROMPT_CHARS,
            "response_tokens": args.max_tokens,
        },  # fmt: skip
        "lengths": args.lengths,
        "pass_costs": args.pass_costs,
        "variants": {},
        "errors": {},
    }
    if args.variant:  # a variant's own process (below): its result to --result
        Path(args.result).write_text(json.dumps(run_variant(args, model_dir, args.variant, device)))
        return 0
    for name in [v for v in VARIANTS if not args.only or v in args.only.split(";")]:
        try:
            if args.in_process:
                R["variants"][name] = run_variant(args, model_dir, name, device)
            else:
                R["variants"][name] = run_in_own_process(args, model_dir, name)
        except Exception as e:  # noqa: BLE001 - one variant failing keeps the others
            R["errors"][name] = traceback.format_exc()[-3000:]
            print(f"  [{name}] failed: {e!r}", flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        out.write_text(json.dumps(R, indent=1) + "\n")
    head = ["update s", "train tok/s", "TFLOP/s", "MFU", "logprobs s", "peak GiB", "passes", "run tokens", "graphs"]
    print(f"\n{'variant':<48} " + " ".join(f"{h:>11}" for h in head))
    for name, r in R["variants"].items():
        mfu = f"{r['update_mfu']:.1%}" if "update_mfu" in r else "-"
        cells = [f"{r['update_s']:.3f}", f"{r['train_tokens_per_s']:,.0f}", f"{r['update_tflops']:.1f}", mfu,
                 f"{r['logprobs_s']:.3f}", f"{r.get('peak_alloc_gib', 0):.1f}", f"{r['passes']:.1f}",
                 f"{r['padded_tokens']:,.0f}", f"{r['graphs']:.0f}"]  # fmt: skip
        print(f"{name:<48} " + " ".join(f"{c:>11}" for c in cells))
    print(f"wrote {out}")
    return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--only", default=None, help="';'-separated variant names")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="CPU check of the script: tiny model")
    p.add_argument("--device", default=None, help="default: cuda (--smoke: cpu)")
    p.add_argument("--model", default=None, help="an HF model folder instead of the reference model")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--lengths", choices=("fixed", "long-tail"), default="fixed", help="response lengths")
    p.add_argument("--pass-costs", default="budget", help="'budget', the cut's own cost of a pass (the only one)")
    p.add_argument("--in-process", action="store_true", help="every variant in this process (default: one each)")
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.pass_costs != "budget":  # the micro-batch cut's cost of a pass is the planner's own, no setting
        p.error("--pass-costs: only 'budget' (the cost of a pass in the trainer's micro-batch cut is not a setting)")
    if args.smoke and not args.variant:
        args.prompts, args.n, args.max_tokens, args.warmup, args.steps = 2, 4, 16, 1, 1
    return args


if __name__ == "__main__":
    sys.exit(main(parse_args()))
