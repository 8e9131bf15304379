"""What the GPU comparison scripts share: the reference model, its prompts and reward, and
putting this checkout's hybridrl on the path.

The reference model is Qwen2.5-0.5B-shaped (Qwen2ForCausalLM: 24 layers, hidden 896, 14 heads
of 64 with 2 KV heads, MLP 4864, vocabulary 151,936, tied embeddings) with random weights built
from its config, so nothing is downloaded. Its tokenizer is byte-level: every prompt byte is one
token, so a 128-character ASCII prompt is exactly 128 tokens, and every one of the 151,936 ids
decodes (ids past the 256 bytes and 3 specials are fixed 2-3 byte strings that encoding never
produces), so engines that detokenize (TRL's vLLM, transformers) handle random samples.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

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
# CPU checks of the scripts (vLLM's CPU attention wants head sizes of 32 or more)
TINY = dict(QWEN05, vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, max_window_layers=2)  # fmt: skip
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PROMPT_CHARS = 128


def use_checkout(*plugins: str) -> None:
    """Import hybridrl and the named plugin folders from this checkout unless installed."""
    try:
        import hybridrl  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(ROOT / "core"))
    import importlib

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


def build_model(folder: Path, shape: dict, dtype: str = "bfloat16") -> str:
    """A random Qwen2ForCausalLM and a byte-level tokenizer of the model's vocabulary, saved once."""
    if (folder / "READY").is_file():
        return str(folder)
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    vocab = byte_vocab(shape["vocab_size"])
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    ).save_pretrained(folder)
    # the same vocabulary as vocab.json/merges.txt, for loaders that build a Qwen2 tokenizer from them
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    cfg = Qwen2Config(**shape, eos_token_id=vocab["<|im_end|>"], pad_token_id=vocab["<|endoftext|>"])
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(folder)
    (folder / "READY").write_text("ok")
    return str(folder)


def prompt(i: int, chars: int = PROMPT_CHARS) -> str:
    """Prompt i: ASCII text of exactly ``chars`` bytes (so tokens)."""
    words = " ".join(f"w{(i * 7919 + k * 104729) % 9973}" for k in range(chars))
    return f"Q{i}: {words}"[:chars]


def even_byte_fraction(text: str) -> float:
    """The reward both frameworks use: the fraction of even bytes in a response."""
    data = text.encode("utf-8", "replace")
    return sum(b % 2 == 0 for b in data) / max(1, len(data))
