"""What the GPU scripts share: the reference model, its prompts and rewards, putting this
checkout's hybridrl on the path, and the run, step loop, summary and table/JSON/exit scaffolding
of the GRPO scripts.

The scripts are clients of hybridrl: they build a run (``hybridrl.run.build_run``), drive it with
``hybridrl.trainer.Trainer``'s public methods, and register what they need (prompts, rewards, an
engine without a model) as a plugin through the contract of ``hybridrl.components``; a figure the
surface does not hand out (the data sheet's peak, a FLOP count) comes from the metrics a step logs or
is counted here. tests/test_benchmarks_surface.py holds them to that.

The reference model is Qwen2.5-0.5B-shaped (Qwen2ForCausalLM: 24 layers, hidden 896, 14 heads
of 64 with 2 KV heads, MLP 4864, vocabulary 151,936, tied embeddings) with random weights built
from its config, so nothing is downloaded. Its tokenizer is byte-level: every prompt byte is one
token, so a 128-character ASCII prompt is exactly 128 tokens, and every one of the 151,936 ids
decodes (ids past the 256 bytes and 3 specials are fixed 2-3 byte strings that encoding never
produces), so engines that detokenize (TRL's vLLM, transformers) handle random samples.
"""

from __future__ import annotations

import gc
import importlib
import itertools
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal, NoReturn  # Literal: the replay engine's options (pydantic reads it here)

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
)
QWEN3B = dict(QWEN05, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
              max_window_layers=36)  # fmt: skip
# CPU checks of the scripts (vLLM's CPU attention wants head sizes of 32 or more)
TINY = dict(QWEN05, vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, max_window_layers=2)  # fmt: skip
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPT_CHARS = 128


def use_checkout(*plugins: str) -> None:
    """Import hybridrl and the named plugin folders from this checkout unless installed."""
    try:
        import hybridrl  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(ROOT / "core"))
    from hybridrl import plugins as registry

    pm = registry.get_plugin_manager()
    for name in plugins:
        try:
            module = importlib.import_module(f"hybridrl_{name}")
        except ImportError:
            sys.path.insert(0, str(ROOT / "plugins" / name))
            module = importlib.import_module(f"hybridrl_{name}")
        if not pm.is_registered(module):  # not installed: no entry point registered it
            pm.register(module, name=name)
    registry.invalidate_registry()


def byte_vocab(size: int) -> dict[str, int]:
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    for n in itertools.count(2):  # filler ids: strings of 2, then 3 byte symbols
        for combo in itertools.product(alphabet, repeat=n):
            if len(vocab) >= size:
                return vocab
            vocab["".join(combo)] = len(vocab)
    return vocab


def save_tokenizer(folder: Path, vocab_size: int, chat_template: str | None = None) -> dict[str, int]:
    """Save the byte-level tokenizer of ``vocab_size`` ids to ``folder``; return its vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    vocab = byte_vocab(vocab_size)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    kwargs = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}
    if chat_template:  # none: no chat_template key in tokenizer_config.json
        kwargs["chat_template"] = chat_template
    PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs).save_pretrained(folder)
    # the same vocabulary as vocab.json/merges.txt, for loaders that build a Qwen2 tokenizer from them
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return vocab


def build_model(
    folder: Path, shape: dict, dtype: str = "bfloat16", chat_template: str | None = None, end_rate: float = 0.0
) -> str:
    """A random Qwen2ForCausalLM and a byte-level tokenizer of the model's vocabulary, saved once.
    ``end_rate``: responses end at random, each sampled token ending its response with about this
    probability (:func:`raise_end_logits`)."""
    if (folder / "READY").is_file():
        return str(folder)
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    vocab = save_tokenizer(folder, shape["vocab_size"], chat_template)
    eos, pad = vocab["<|im_end|>"], vocab["<|endoftext|>"]
    cfg = Qwen2Config(**shape, eos_token_id=eos, pad_token_id=pad)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    ends = long_tail_end_ids(shape["vocab_size"], LONG_TAIL_END_IDS) if end_rate else []
    measured = raise_end_logits(model, ends, end_rate) if end_rate else None
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    if end_rate:  # after the model's own generation_config.json
        GenerationConfig(eos_token_id=[eos, *ends], pad_token_id=pad).save_pretrained(folder)
        (folder / "END_RATE.json").write_text(json.dumps({"wanted": end_rate, "calibrated": measured, "ids": ends}))
    (folder / "READY").write_text("ok")
    return str(folder)


LONG_TAIL_END_IDS = 4  # end ids of the long-tail models, besides <|im_end|>


def long_tail_end_ids(vocab_size: int, count: int) -> list[int]:
    """``count`` filler ids spread over the vocabulary (past the bytes and the special tokens)."""
    first = 300
    stride = (vocab_size - first) // count
    return [first + i * stride for i in range(count)]


def raise_end_logits(model, ids: list[int], rate: float, dim: int = 0, c: float = 0.05) -> float:
    """Make each token that ``model`` samples one of ``ids`` with probability about ``rate``, for
    responses of random lengths (geometric: with rate = 4 / max_tokens the mean is about
    max_tokens / 4 and about e^-4 = 1.8% reach max_tokens) that every engine ends alike, with a
    few end ids in generation_config.json. (Thousands of end ids of a random model's nearly
    uniform distribution would do the same, but vLLM tests each token against its stop ids with
    ``in`` on a list, which costs about 30 us a token with 2,373 of them.)

    Qwen2 has no output bias, so one residual dimension (``dim``) is held constant: the embedding of
    every token holds ``c`` there and no layer writes to it (its rows of the attention's and the
    MLP's output projections are zero), so the final hidden state holds ``c`` / rms there at
    every position. The output rows of ``ids`` then get a larger value at ``dim`` (their input
    embeddings too where tied; an end token is the last of its response), chosen by bisection on
    the hidden states of random tokens after a byte prompt, as engines see them while sampling.
    Returns the mean probability of ending a token measured there."""
    import torch

    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    with torch.no_grad():
        emb[:, dim] = c
        head[:, dim] = c
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[dim].zero_()
            layer.mlp.down_proj.weight[dim].zero_()
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(32, 127, (4, 64), generator=g)
        sampled = torch.randint(300, emb.shape[0], (4, 64), generator=g)
        hidden = model.model(input_ids=torch.cat([prompt, sampled], 1)).last_hidden_state[:, 64:].float()
        hidden = hidden.reshape(-1, hidden.shape[-1])  # (n, H)
        logits = hidden @ head.float().T  # (n, V): every end id still at c
        base = logits[:, ids]  # (n, k)
        others = torch.logsumexp(logits.index_fill(1, torch.tensor(ids), float("-inf")), -1)  # (n,)

        def end_probability(value: float) -> float:
            ends = base + hidden[:, dim : dim + 1] * (value - c)  # (n, k)
            lse = torch.logsumexp(ends, -1)
            return torch.sigmoid(lse - others).mean().item()  # P(any end id) at each position

        lo, hi = c, c + 1.0
        while end_probability(hi) < rate:
            hi += 2 * (hi - lo)
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if end_probability(mid) < rate else (lo, mid)
        head[ids, dim] = hi
        emb[ids, dim] = hi
    return end_probability(hi)


def prompt(i: int, chars: int = PROMPT_CHARS) -> str:
    """Prompt i: ASCII text of exactly ``chars`` bytes (so tokens)."""
    words = " ".join(f"w{(i * 7919 + k * 104729) % 9973}" for k in range(chars))
    return f"Q{i}: {words}"[:chars]


def even_byte_fraction(text: str) -> float:
    """The reward both frameworks use: the fraction of even bytes in a response."""
    data = text.encode("utf-8", "replace")
    return sum(b % 2 == 0 for b in data) / max(1, len(data))


# -- the GRPO scripts (gpu_vllm_grpo.py, gpu_sglang_grpo.py) -------------------------------


def bench_plugin(datasets: dict[str, type], rewards: dict[str, type], engines: dict[str, type] | None = None):
    """A plugin object that registers these prompt sources, reward functions and rollout engines by name."""
    from hybridrl.hookspecs import hookimpl

    class Bench:
        @hookimpl
        def register_datasets(self, register):
            for name, cls in datasets.items():
                register(name, cls)

        @hookimpl
        def register_reward_functions(self, register):
            for name, cls in rewards.items():
                register(name, cls)

        @hookimpl
        def register_rollout_engines(self, register):
            for name, cls in (engines or {}).items():
                register(name, cls)

    return Bench()


def token_task_plugin():
    """A plugin with the prompt source ``bench_sums`` (addition questions), the rewards
    ``even_tokens`` (the fraction of even token ids in a response: about 0.5 at random, and
    learnable) and ``random_scores`` (seeded uniform scores), and the rollout engine ``bench_replay``
    (:func:`replay_engine`). Import hybridrl first (use_checkout)."""
    import torch
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

    class RandomScores(RewardFunction):
        """Uniform scores in [0, 1), seeded by the call: a batch whose advantages are not all zero."""

        def __init__(self, options, ctx):
            super().__init__(options, ctx)
            self.calls = 0

        def score(self, batch):
            self.calls += 1
            return torch.rand(len(batch), generator=torch.Generator().manual_seed(self.calls)).tolist()

    rewards = {"even_tokens": EvenTokens, "random_scores": RandomScores}
    return bench_plugin({"bench_sums": Sums}, rewards, {"bench_replay": replay_engine()})


def replay_engine() -> type:
    """The rollout engine ``bench_replay``: responses of random token ids drawn without a model, for
    runs whose rollouts are not what is measured (the update alone, the trainer's pass over given
    tokens). A call's ``n`` responses per prompt have ``max_tokens`` ids from ``low_id`` up, each
    logprob -5; with ``response_lengths: long-tail`` each is cut at a geometric length (mean about
    max_tokens / 4, capped at max_tokens) drawn with the call's number as seed (``fixed``: seed 0,
    every call the same tokens). ``last``: the prompts and output of the last call. It loads no
    weights (a sync costs the trainer's gather alone) and runs no sync check: set
    ``rollout.sync_check: 0``."""
    import torch
    from pydantic import Field

    from hybridrl.components import Options as BaseOptions
    from hybridrl.components import RolloutEngine, RolloutOutput

    class Replay(RolloutEngine):
        weight_format = "transformers"

        class Options(BaseOptions):
            low_id: int = Field(300, ge=0, description="The smallest token id drawn.")
            response_lengths: Literal["fixed", "long-tail"] = Field("fixed", description="Lengths of responses.")

        def __init__(self, options, ctx):
            super().__init__(options, ctx)
            from transformers import AutoConfig

            self.vocab = AutoConfig.from_pretrained(ctx.model_path).vocab_size
            self.calls, self.last = 0, None

        def generate(self, prompts, sampling):
            self.calls += 1
            long_tail = self.options.response_lengths == "long-tail"
            g = torch.Generator().manual_seed(self.calls if long_tail else 0)
            rows, T = len(prompts) * sampling.n, sampling.max_tokens
            tokens = torch.randint(self.options.low_id, self.vocab, (rows, T), generator=g).tolist()
            if long_tail:  # geometric, mean about max/4, a few at max
                lengths = torch.empty(rows).exponential_(4 / T, generator=g).ceil().clamp(1, T)
                tokens = [row[: int(k)] for row, k in zip(tokens, lengths)]
            reasons = ["length" if len(t) == T else "stop" for t in tokens]
            out = RolloutOutput(tokens, [[-5.0] * len(t) for t in tokens], reasons)
            self.last = (prompts, out)
            return out

        def update_weights(self, named_tensors):
            pass  # nothing to load: no model

    return Replay


def register_bench_plugin() -> None:
    """Register :func:`token_task_plugin` as ``bench`` (once a process). Import hybridrl first."""
    from hybridrl import plugins as registry

    pm = registry.get_plugin_manager()
    if not pm.has_plugin("bench"):
        pm.register(token_task_plugin(), name="bench")
        registry.invalidate_registry()


# what both keep of Trainer.step's metrics; each adds its engine's
GRPO_KEEP = (
    "reward/mean",
    "throughput/rollout_tokens_per_s",
    "timing/rollout",
    "timing/update",
    "timing/sync",
    "timing/step",
    "rollout/logprob_diff_mean",
    "rollout/logprob_diff_max",
)


def start_grpo(result: dict, script: str, cuda: bool, plugins: tuple[str, ...], engine: str | None) -> None:
    """Check that a CUDA GPU is visible (``cuda``: not --smoke), import hybridrl with ``plugins``
    and the benchmark's prompts and reward (token_task_plugin), and record in ``result`` the
    versions (``engine``'s too, a module imported by name, unless None) and the GPU's name."""
    import torch

    if cuda and not torch.cuda.is_available():
        raise SystemExit(f"{script}: no CUDA GPU visible; --smoke runs the CPU check of the script.")
    try:
        import pydantic  # noqa: F401
        import yaml  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"{script}: hybridrl needs {e.name}: pip install pydantic pyyaml") from None
    use_checkout(*plugins)
    register_bench_plugin()
    import transformers

    result["versions"] = {"python": platform.python_version(), "torch": torch.__version__,
                          "transformers": transformers.__version__}  # fmt: skip
    if engine:
        result["versions"][engine] = importlib.import_module(engine).__version__
    if cuda:
        result["gpu"] = torch.cuda.get_device_name(0)


def build_trainer(result: dict, cfg: dict, name: str):
    """A hybridrl Trainer over the run of the config dict ``cfg`` (recorded in ``result``); building
    the run loads the policy and starts the engine (timed: ``setup_s``)."""
    from hybridrl.config import load_config
    from hybridrl.run import build_run
    from hybridrl.trainer import Trainer

    result["config"] = cfg
    config = load_config(data=cfg)
    t = time.perf_counter()
    run = build_run(config, name=name)
    result["setup_s"] = round(time.perf_counter() - t, 2)
    return Trainer(run)


Hook = Callable[[int, dict], None]


def run_steps(
    trainer,
    steps: int,
    keep: tuple[str, ...],
    result: dict,
    path: Path,
    columns: list,
    before: Hook | None = None,
    after: Hook | None = None,
    close: Callable[[], None] | None = None,
) -> None:
    """Steps 1 to ``steps`` of ``trainer``, its record opened and closed as Trainer.train does
    (its checkpoint at the end is not wanted here). Each step's record: the step, what
    ``before(step, record)`` adds, the metrics named in ``keep`` and what ``after(step, record)``
    adds, floats rounded to 5 places; it goes to ``result["steps"]``, ``result`` is written to
    ``path`` and the row printed (print_row). At the end, failed or not, the trainer is closed (its
    loggers, engine and rewards released), by ``close()`` where given."""
    trainer.open(steps)
    try:
        for step in range(1, steps + 1):
            record: dict = {"step": step}
            if before:
                before(step, record)
            metrics = trainer.step(step)
            record |= {k: metrics[k] for k in keep if k in metrics}
            if after:
                after(step, record)
            result["steps"].append({k: round(v, 5) if isinstance(v, float) else v for k, v in record.items()})
            write_json(result, path)
            print_row(result["steps"][-1], columns)
    finally:
        (close or trainer.close)()


def median(rows: list[dict], key: str) -> float | None:
    """The median of ``key`` over the rows that have it, to 4 places; None if none has it."""
    values = [r[key] for r in rows if key in r]
    return round(statistics.median(values), 4) if values else None


def grpo_summary(steps: list[dict], **engine: float | None) -> dict:
    """Medians over the steps after the first (which warms up kernels) of what every engine
    reports, with the ``engine``'s own figures after the weight sync, and the extremes."""
    later = steps[1:] or steps
    return {
        "steps_in_median": len(later),
        "rollout_tokens_per_s": median(later, "throughput/rollout_tokens_per_s"),
        "weight_sync_s": median(later, "timing/sync"),
        **engine,
        "logprob_diff_mean": median(later, "rollout/logprob_diff_mean"),
        "logprob_diff_max": max((s.get("rollout/logprob_diff_max", 0.0) for s in steps), default=None),
        "step_s": median(later, "timing/step"),
        "reward_first": steps[0].get("reward/mean") if steps else None,
        "reward_last": steps[-1].get("reward/mean") if steps else None,
    }


def out_path(given: str | None, name: str) -> Path:
    """The JSON file: ``given`` (--out), else ``$OUT/name`` when OUT is set, else ``./name``."""
    if given:
        return Path(given)
    return Path(os.environ["OUT"]) / name if os.environ.get("OUT") else Path(name)


def cpu_header(args) -> dict:
    """A CPU benchmark's result before its figures: when, on what, with which settings."""
    import torch

    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "torch": torch.__version__,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},  # not where this machine wrote it
        "sides": {},
    }


def write_json(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")


def print_row(row: dict, columns: list[tuple[str, str, str]]) -> None:
    """One table row of ``columns`` (header, key in row, format); the header before step 1."""
    if row["step"] == 1:
        print(" | ".join(name for name, _, _ in columns), flush=True)
    cells = []
    for name, key, fmt in columns:
        value = row.get(key)
        cells.append(fmt.format(value) if value is not None else f"{'-':>{len(name)}}")
    print(" | ".join(cells), flush=True)


def print_sides(result: dict, columns: list[tuple[str, str | None, str]], path: Path) -> None:
    """The comparison's table, a row per side of ``result["summary"]`` (side: its figures; the first
    column the side's name, the others (header, key in the figures, format), '-' where a side lacks
    a figure), then ``result["ratios"]`` and where the JSON went."""
    print()
    print(" | ".join(name for name, _, _ in columns))
    for side, s in result["summary"].items():
        cells = [columns[0][2].format(side)]
        for name, key, fmt in columns[1:]:
            cells.append(fmt.format(s[key]) if s.get(key) is not None else f"{'-':>{len(name)}}")
        print(" | ".join(cells))
    for k, v in result["ratios"].items():
        print(f"{k}: {v:.2f}x")
    print(f"wrote {path}")


def run_and_exit(main: Callable, args, result: dict, path: Path) -> NoReturn:
    """Run ``main(args)``, record in ``result`` what failed, write it to ``path``, print its summary
    and exit without waiting for the engine's threads and child processes."""
    result["started"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    result["argv"] = sys.argv[1:]
    code = 0
    try:
        main(args)
    except BaseException as e:  # noqa: BLE001 - record what failed, then exit non-zero
        result["ok"] = False
        result["errors"].append({"error": repr(e)[:2000], "traceback": traceback.format_exc()[-4000:]})
        traceback.print_exc()
        code = 1
    write_json(result, path)
    print("RESULT_JSON " + json.dumps(result.get("summary"), default=str), flush=True)
    print(f"wrote {path}", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def wait_for_gpu() -> None:
    """Wait for queued GPU work, so that a timer stops when the work does (no-op on a CPU)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


# -- what a script needs of a run beside its steps ------------------------------------------------


def resolve_model(model: dict, workdir: Path) -> tuple[str, object]:
    """The plain model folder a run trains from the config's model section ``model`` (a GGUF file
    converted once, and cached) and the run's tokenizer: a run for evaluation alone is built on the
    CPU and closed. Registers the bench plugin (its prompts and reward stand in for the data)."""
    from hybridrl.config import load_config
    from hybridrl.run import build_run

    register_bench_plugin()
    sums = {"source": "bench_sums", "size": 4, "chat_template": False}
    cfg = {
        "model": model,
        "data": {**sums, "eval": [{"name": "probe", **sums}]},
        "rewards": [{"function": "even_tokens"}],
        "trainer": {"device": "cpu", "run_dir": str(workdir / "resolve-model"), "sample_every": 0},
        "logging": {"loggers": []},
    }
    run = build_run(load_config(data=cfg), name="bench-resolve", train=False)
    try:
        return run.ctx.model_path, run.tokenizer
    finally:
        run.close()


def load_tokenizer(path: str):
    """The tokenizer of a model folder, padding with EOS where it has no padding token (as a run's)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(path: str, dtype, device):
    """A transformers copy of a model folder in ``dtype`` on ``device`` (a source of weights to send)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)


def scoring_run(model_dir: str, device, workdir: Path, name: str = "bench-scoring"):
    """A run whose policy is ``model_dir`` in float32 on ``device``, without autocast, and whose
    engine loads no model (``bench_replay``): its pass runner scores given responses as the trainer
    does (:func:`trainer_logprobs`). Needs the grpo plugin (use_checkout("algo_grpo")). Close it with
    ``run.close()``."""
    from hybridrl.config import load_config
    from hybridrl.run import build_run

    register_bench_plugin()
    cfg = {
        "model": {"path": model_dir, "dtype": "float32"},
        "data": {"source": "bench_sums", "size": 64, "chat_template": False},
        "rollout": {"engine": "bench_replay", "sync_check": 0},
        "rewards": [{"function": "even_tokens"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.0},
        "sharding": {"strategy": "single", "mixed_precision": "off"},
        "trainer": {"device": str(device), "run_dir": str(workdir / name), "sample_every": 0},
        "logging": {"loggers": []},
    }
    return build_run(load_config(data=cfg), name=name)


def trainer_logprobs(run, prompts: list[list[int]], out, n: int):
    """(B, T) logprobs of the responses ``out`` (a RolloutOutput, ``n`` a prompt) under the run's
    policy at temperature 1, in the passes the trainer plans (``run.passes``), and the batch."""
    from hybridrl.batch import Batch

    batch = Batch.from_rollout(prompts, out, n, run.tokenizer.pad_token_id).to(run.ctx.device)
    return run.passes.logprobs(run.policy, batch, 1.0, "policy"), batch


def matmul_flops(model, seq_lens: list[int], logit_tokens: int) -> float:
    """FLOPs of one forward pass over sequences of ``seq_lens`` tokens, ``logit_tokens`` of them through
    the output layer, counted as the trainer counts them for its MFU (throughput/update_mfu): matrix
    multiplications only, 2 FLOPs a multiply-add; every weight matrix of the body once a token, the
    output layer once a token whose logits are computed, causal attention (scores and weighted sum)
    over each sequence's own length. ``model``: a transformers causal LM (on the meta device will do).
    A training pass is 3x."""
    from hybridrl.flops import forward_flops

    return forward_flops(model, seq_lens, logit_tokens)


def peak_from_metrics(rows: list[dict], tflops: str = "update_tflops", mfu: str = "update_mfu") -> float | None:
    """The peak (FLOP/s) a trainer's MFU is counted against, from rows of its logged metrics: the
    update's TFLOP/s over its MFU (the data sheet's dense bf16 figure; None where it logged no MFU)."""
    peaks = [r[tflops] * 1e12 / r[mfu] for r in rows if r.get(tflops) and r.get(mfu)]
    return float(f"{statistics.median(peaks):.4g}") if peaks else None


def trainer_peak_flops(workdir: Path) -> float | None:
    """The GPU's dense bf16 peak (FLOP/s) that the trainer's MFU is counted against, read from the
    metrics of one step of a tiny run (:func:`peak_from_metrics`); None on a CPU, or a GPU whose peak
    the trainer does not know. Needs the grpo plugin (use_checkout("algo_grpo"))."""
    import torch

    from hybridrl.config import load_config
    from hybridrl.run import build_run
    from hybridrl.trainer import Trainer

    if not torch.cuda.is_available():
        return None
    register_bench_plugin()
    cfg = {
        "model": {"path": build_model(workdir / "tiny", TINY, "float32")},
        "data": {"source": "bench_sums", "size": 64, "chat_template": False},
        "rollout": {"engine": "bench_replay", "sync_check": 0, "n": 2, "max_tokens": 8},
        "rewards": [{"function": "random_scores"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.0},
        "trainer": {
            "steps": 1,
            "prompts_per_step": 2,
            "device": "cuda",
            "sample_every": 0,
            "run_dir": str(workdir / f"peak-{time.time_ns()}"),
        },
        "logging": {"loggers": []},
    }
    trainer = Trainer(build_run(load_config(data=cfg), name="bench-peak"))
    trainer.open(1)
    try:
        metrics = trainer.step(1)
    finally:
        trainer.close()
    del trainer
    gc.collect()  # the tiny run's memory back before what is measured next
    torch.cuda.empty_cache()
    return peak_from_metrics([{k.split("/")[-1]: v for k, v in metrics.items() if k.startswith("throughput/")}])


def trl_grpo_config(output_dir: str, prompts: int, n: int, max_tokens: int, **overrides):
    """TRL's GRPOConfig with the hyper-parameters the hybridrl side of every comparison uses:
    ``prompts`` x ``n`` completions of ``max_tokens`` tokens per step in one update, KL beta
    0.04, lr 1e-6, temperature 1, seed 0; nothing saved or reported. ``overrides``: the rest
    (steps, precision, the engine, how EOS is ignored)."""
    from trl import GRPOConfig

    base = dict(
        output_dir=output_dir,
        per_device_train_batch_size=prompts * n,
        num_generations=n,
        max_completion_length=max_tokens,
        beta=0.04,
        learning_rate=1e-6,
        save_strategy="no",
        report_to="none",
        seed=0,
        temperature=1.0,
        dataloader_num_workers=0,
    )
    return GRPOConfig(**(base | overrides))
