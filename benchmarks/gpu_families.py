#!/usr/bin/env python3
"""Every model family through the hf engine's GPU path on a GPU: exactness, not speed.

    python benchmarks/gpu_families.py                          # every family, on the GPU
    python benchmarks/gpu_families.py --archs gemma3,phi3 --compiled gemma3
    python benchmarks/gpu_families.py --smoke                  # CPU check of the script

tests/test_architectures.py runs the engine's GPU path on the CPU, with the graph pool and the
captures stood in for; this runs it as on a user's GPU. The families are hybridrl_testing.models'
tiny random checkpoints, saved as each family ships (bf16 weights, its config keys, sliding windows
of 16 tokens, Phi-3's LongRoPE with an original length of 64), with ten more end ids (3-12, about
a tenth of the sampled tokens) so that response lengths vary. For each family:

- ``decode``: the hf engine with its defaults on the GPU for a short run (static cache, fused
  projections, grouped decoding attention, rows moved to loops of fewer rows as responses end,
  eager steps, every loop captured in CUDA graphs at the first call) in float32, 256 prompts of
  3-110 tokens, up to 48 tokens: the largest difference between its logprobs and the trainer's pass
  over the same responses (the pass runner of a run of the checkpoint, ``common.scoring_run``), the
  response lengths, the loops made and the graphs captured (``hf/graph_*``);
- ``compiled`` (families named in ``--compiled``): the same engine with ``compile: on``, greedy,
  against the eager engine, in float32 and in bfloat16: the rows whose tokens are the same and
  the largest logprob difference on them, and the compile time;
- ``fallback`` (families named in ``--fallback``, default Llama): ``decode`` with a forward that reads
  a value back to the host (a hook on the engine's model), which a CUDA graph capture refuses: the
  engine says so once (``uncapturable``, from its log line) and decodes on without graphs, its
  logprobs still the trainer's (a failed capture used to leave the CUDA
  generator in capture mode, and the next random draw raised);
- ``train fp32`` and ``train bf16``: the tests' two GRPO steps through the trainer
  (``two_grpo_steps``: packed passes, 32 prompts x 4 samples here, the sync checked after each)
  with float32 compute (``mixed_precision: off``, engine dtype float32) and with the defaults (bf16
  autocast, a bf16 engine): rollout/logprob_diff_max and rollout/sync_check_diff_max of each step.

Prints a table and writes JSON (``--out``; default ``$OUT/families_gpu.json`` when OUT is set).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

END_IDS = list(range(3, 13))


def checkpoint(folder: Path, arch: str) -> str:
    """The family's tiny checkpoint with END_IDS among its end ids (generation_config.json)."""
    from hybridrl_testing.models import build_checkpoint

    path = build_checkpoint(folder / arch, arch)
    gen = Path(path) / "generation_config.json"
    cfg = json.loads(gen.read_text())
    gen.write_text(json.dumps(cfg | {"eos_token_id": cfg["eos_token_id"] + END_IDS}, indent=2))
    return path


def question(i: int) -> str:
    """The i-th prompt: 3 to 110 characters (one token each), past every window and original length."""
    return f"q{i * 37 % 101} {chr(97 + i % 26) * (1 + i % 5 * 25)}"


def prompts(tokenizer, count: int) -> list[list[int]]:
    return [tokenizer(question(i))["input_ids"] for i in range(count)]


def engine(path: str, device, workdir: Path, sampling=None, **options):
    import torch

    from hybridrl import plugins
    from hybridrl.components import RunContext, Sampling

    cls = plugins.lookup("rollout engine", "hf")
    tokenizer = common.load_tokenizer(path)
    ctx = RunContext(path, tokenizer, device, torch.float32, 0, workdir, sampling=sampling or Sampling())
    return cls(cls.Options(**{"dtype": "float32"} | options), ctx)


def read_host(module, args, output) -> None:
    """A forward hook that reads a value back to the host, as some models' forwards do: a CUDA graph
    capture refuses it."""
    float(output.float().sum())


CANNOT_CAPTURE = re.compile(r"rollout engine 'hf': (eager|compiled) decoding cannot be captured")


@contextlib.contextmanager
def echoed_stdout():
    """What is printed inside the block, printed and kept (the engine says there which captures failed)."""
    kept, out = io.StringIO(), sys.stdout

    class Tee(io.TextIOBase):
        def write(self, text):
            kept.write(text)
            return out.write(text)

        def flush(self):
            out.flush()

    with contextlib.redirect_stdout(Tee()):
        yield kept


def decode(path: str, device, workdir: Path, count: int, host_sync: bool = False, **options) -> dict:
    import torch

    from hybridrl.components import SamplingParams

    e = engine(path, device, workdir, **options)
    if host_sync:  # every decoding step's forward waits for the device
        e.model.get_input_embeddings().register_forward_hook(read_host)
    p = prompts(e.tokenizer, count)
    with echoed_stdout() as said:
        out = e.generate(p, SamplingParams(n=1, max_tokens=48, seed=0))
    stats = e.metrics()
    e.close()
    run = common.scoring_run(path, device, workdir)  # the trainer's pass over the same responses
    try:
        lp, batch = common.trainer_logprobs(run, p, out, 1)
    finally:
        run.close()
    mask = batch["response_mask"].bool()
    lengths = sorted(len(t) for t in out.token_ids)
    return {
        "static": e.static,
        "fused_groups": e.fused_groups,
        "grouped_attention": bool(e.grouped_attention),
        "lengths_min_median_max": [lengths[0], lengths[len(lengths) // 2], lengths[-1]],
        "logprob_diff_max": (lp[mask] - batch["rollout_logprobs"][mask]).abs().max().item(),
        "nan": bool(torch.isnan(batch["rollout_logprobs"][mask]).any()),
        "uncapturable": sorted(set(CANNOT_CAPTURE.findall(said.getvalue()))),
        **{k: v for k, v in stats.items() if k.startswith("hf/graph")},
    }


def compiled(path: str, device, workdir: Path, count: int) -> dict:
    """Greedy compiled decoding against the eager engine's, in float32 and in bfloat16 (the engine's
    dtype on a GPU; Qwen3-MoE's and Mixtral's experts take another matmul path there). In bfloat16
    the two may part at a near tie, after which the tokens differ."""
    from hybridrl.components import Sampling, SamplingParams

    out = {}
    for dtype in ("float32", "bfloat16"):
        on, off = (engine(path, device, workdir, Sampling(top_k=1), compile=c, dtype=dtype) for c in ("on", "off"))
        p = prompts(on.tokenizer, count)
        sp = SamplingParams(n=1, max_tokens=48, seed=0, top_k=1)
        t = time.perf_counter()
        got = on.generate(p, sp)
        first_s = time.perf_counter() - t
        want = off.generate(p, sp)
        same = [x == y for x, y in zip(got.token_ids, want.token_ids)]
        diff = max(abs(a - b) for x, y, s in zip(got.logprobs, want.logprobs, same) if s for a, b in zip(x, y))
        out[dtype] = {
            "same_tokens_rows": f"{sum(same)}/{len(same)}",
            "logprob_diff_max_same_rows": diff,
            "first_call_s": first_s,
            "compile_s": on.metrics().get("hf/compile_s"),
        }
    return out


def train(path: str, run_dir: Path, fp32: bool, smoke: bool) -> dict:
    """hybridrl_testing.models.two_grpo_steps (the tests' two steps) on this script's prompts, with 48
    tokens a response; float32 (``fp32``) or the defaults."""
    from hybridrl_testing import SevensReward
    from hybridrl_testing.models import two_grpo_steps

    from hybridrl import plugins
    from hybridrl.components import PromptSource

    class Questions(PromptSource):
        def __len__(self):
            return 256

        def __getitem__(self, i):
            return {"question": question(i), "answer": None}

    pm = plugins.get_plugin_manager()
    if not pm.has_plugin("families"):
        pm.register(common.bench_plugin({"questions": Questions}, {"sevens": SevensReward}), name="families")
        plugins.invalidate_registry()
    data = {"source": "questions", "chat_template": False, "answer_column": None}
    precision = ({"mixed_precision": "off"}, {"dtype": "float32"}) if fp32 else ({}, {})
    rows = two_grpo_steps(
        path, run_dir, data=data, prompts=4 if smoke else 32, sharding=precision[0], max_tokens=48, **precision[1]
    )
    keys = ("rollout/logprob_diff_max", "rollout/logprob_diff_mean", "rollout/sync_check_diff_max")
    keys += ("response_length/mean", "prompt_length/mean", "hf/graph_captures", "hf/decoded_row_fraction")
    return {"steps": [{k.removeprefix("rollout/"): r.get(k) for k in keys} for r in rows]}


def run_part(part: str, path: str, device, workdir: Path, count: int, smoke: bool) -> dict:
    workdir.mkdir(parents=True)
    cache = {"cache": "static"} if smoke else {}  # the CPU's default is the dynamic cache
    if part == "decode":  # eager steps in CUDA graphs: what compile auto picks for a short run
        return decode(path, device, workdir, count, compile="off", **cache)
    if part == "compiled":
        return compiled(path, device, workdir, count)
    if part == "fallback":  # a step that cannot be captured: the engine decodes on without graphs
        return decode(path, device, workdir, count, host_sync=True, compile="off", **cache)
    return train(path, workdir / "run", part == "train fp32", smoke)


def one_family(arch: str, args, work: Path) -> dict:
    """Every part for ``arch`` in this process; a part that fails keeps its error, not the others'."""
    import torch

    device = torch.device("cpu" if args.smoke else "cuda")
    count, row = 16 if args.smoke else 256, {}
    path = checkpoint(work / "models", arch)
    for part in args.parts.split(","):
        if part in ("compiled", "fallback") and arch not in getattr(args, part).split(","):
            continue
        t = time.perf_counter()
        try:
            got = run_part(part, path, device, work / part.replace(" ", "-"), count, args.smoke)
        except Exception as e:
            traceback.print_exc()
            got = {"error": f"{type(e).__name__}: {e}"[:500]}
        row[part] = got | {"seconds": round(time.perf_counter() - t, 1)}
        print(f"{arch:>10} {part:<11} {json.dumps(row[part])}", flush=True)
    return row


def main() -> None:
    common.use_checkout("algo_grpo")
    from hybridrl_testing.models import ARCHITECTURES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", default=None, help=f"comma-separated, from {', '.join(ARCHITECTURES)} (default: all)")
    p.add_argument("--compiled", default="", help="comma-separated families to also decode compiled")
    p.add_argument("--fallback", default="llama", help="comma-separated families to also decode with a host sync")
    p.add_argument("--parts", default="decode,compiled,fallback,train fp32,train bf16")
    p.add_argument("--smoke", action="store_true", help="on the CPU, fewer prompts (default families: llama, gemma3)")
    p.add_argument("--family-timeout", type=float, default=240)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # one family, in this process (the JSON to --out)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.one:
        with tempfile.TemporaryDirectory() as tmp:
            common.write_json(one_family(args.one, args, Path(tmp)), Path(args.out))
        return
    archs = args.archs.split(",") if args.archs else ["llama", "gemma3"] if args.smoke else list(ARCHITECTURES)
    path_out = common.out_path(args.out, "families_gpu.json")
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.machine()}
    common.start_grpo(result, "gpu_families.py", not args.smoke, ("algo_grpo",), None)
    result |= {"config": vars(args), "families": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in archs:  # each in its own process: a failed CUDA graph capture can leave the device unusable
            row_file = Path(tmp) / f"{arch}.json"
            cmd = [sys.executable, __file__, "--one", arch, "--out", str(row_file), "--parts", args.parts]
            cmd += ["--compiled", args.compiled, "--fallback", args.fallback, *(["--smoke"] if args.smoke else [])]
            try:
                code = subprocess.run(cmd, timeout=args.family_timeout).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
            row = json.loads(row_file.read_text()) if row_file.exists() else {"error": f"exit {code}"}
            result["families"][arch] = row
            common.write_json(result, path_out)
    print_table(result)


def print_table(result: dict) -> None:
    def f(x):
        return "-" if x is None else f"{x:.2e}"

    print(f"\n{'family':>10} | decode diff | loops | captures | train fp32 diff / sync | train bf16 diff / sync")
    for arch, row in result["families"].items():
        d = row.get("decode", {})
        tr = {k: row.get(k, {}).get("steps", [{}]) for k in ("train fp32", "train bf16")}
        cells = [
            " / ".join(f"{f(s.get('logprob_diff_max'))} {f(s.get('sync_check_diff_max'))}" for s in steps)
            for steps in tr.values()
        ]
        print(
            f"{arch:>10} | {f(d.get('logprob_diff_max'))} | {d.get('hf/graph_new_loops', '-')} | "
            f"{d.get('hf/graph_captures', '-')} | {cells[0]} | {cells[1]}"
        )


if __name__ == "__main__":
    main()
