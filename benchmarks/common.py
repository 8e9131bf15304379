"""What the GPU scripts share: the reference model, its prompts and rewards, putting this
checkout's hybridrl on the path, and the setup, step loop, summary and table/JSON/exit scaffolding
of the GRPO scripts.

The reference model is Qwen2.5-0.5B-shaped (Qwen2ForCausalLM: 24 layers, hidden 896, 14 heads
of 64 with 2 KV heads, MLP 4864, vocabulary 151,936, tied embeddings) with random weights built
from its config, so nothing is downloaded. Its tokenizer is byte-level: every prompt byte is one
token, so a 128-character ASCII prompt is exactly 128 tokens, and every one of the 151,936 ids
decodes (ids past the 256 bytes and 3 specials are fixed 2-3 byte strings that encoding never
produces), so engines that detokenize (TRL's vLLM, transformers) handle random samples.
"""

from __future__ import annotations

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
from typing import NoReturn

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


def bench_plugin(datasets: dict[str, type], rewards: dict[str, type]):
    """A plugin object that registers these prompt sources and reward functions by name."""
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

    return Bench()


def token_task_plugin():
    """A plugin with the prompt source ``bench_sums`` (addition questions) and the reward
    ``even_tokens`` (the fraction of even token ids in a response: about 0.5 at random, and
    learnable). Import hybridrl first (use_checkout)."""
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

    return bench_plugin({"bench_sums": Sums}, {"even_tokens": EvenTokens})


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
    from hybridrl import plugins as registry

    registry.get_plugin_manager().register(token_task_plugin(), name="bench")
    registry.invalidate_registry()
    import transformers

    result["versions"] = {"python": platform.python_version(), "torch": torch.__version__,
                          "transformers": transformers.__version__}  # fmt: skip
    if engine:
        result["versions"][engine] = importlib.import_module(engine).__version__
    if cuda:
        result["gpu"] = torch.cuda.get_device_name(0)


def setup_trainer(result: dict, cfg: dict, name: str):
    """A hybridrl Trainer of the config dict ``cfg`` (recorded in ``result``), after its setup(),
    which loads the policy and starts the engine (timed: ``setup_s``)."""
    from hybridrl.config import load_config
    from hybridrl.trainer import Trainer

    result["config"] = cfg
    trainer = Trainer(load_config(data=cfg), name=name)
    t = time.perf_counter()
    trainer.setup()
    result["setup_s"] = round(time.perf_counter() - t, 2)
    return trainer


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
    """Steps 1 to ``steps`` of ``trainer``, with its loggers opened and closed as Trainer.train
    does (its checkpoint at the end is not wanted here). Each step's record: the step, what
    ``before(step, record)`` adds, the metrics named in ``keep`` and what ``after(step, record)``
    adds, floats rounded to 5 places; it goes to ``result["steps"]``, ``result`` is written to
    ``path`` and the row printed (print_row). At the end, failed or not, the loggers are closed
    and the engine too, by ``close()`` where given."""
    for logger in trainer.loggers:
        logger.open(steps, 0)
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
        for logger in trainer.loggers:
            logger.close()
        (close or trainer.engine.close)()


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
