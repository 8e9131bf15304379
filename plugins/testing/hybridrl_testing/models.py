"""Tiny random checkpoints of every model family users bring, saved the way real ones ship.

``build_checkpoint(path, arch)`` writes a folder that ``from_pretrained`` and every engine load:
bfloat16 safetensors, the ``config.json`` keys of the family's first releases (``rope_scaling``
beside ``rope_theta``, as Llama-3.1, Phi-3 and Qwen2 ship them, not transformers 5's
``rope_parameters``), a ``generation_config.json`` with sampling settings and two end ids, and the
character-level tokenizer with a ChatML template with tools of :func:`hybridrl_testing.build_tiny_model`.

Every model has 2 layers, attention heads of 32 (the smallest vLLM's CPU attention runs) and the
feature that sets its family apart: Llama-3's rope scaling, Phi-3's longrope (long factors far
from the short ones; and the first release's ``su``), Qwen3's q/k norms, Qwen3-MoE's and
Mixtral's experts (fused in transformers 5, one tensor per expert in the checkpoint), Gemma-2's
soft-capping (attention scores that reach the cap) and sliding window, Gemma-3's local/global
layers, Mistral's sliding window, GPT-2's Conv1D layers and learned positions; tied and untied
output layers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ARCHITECTURES = (
    "llama",
    "phi3",
    "phi3-su",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "gemma2",
    "gemma3",
    "mistral",
    "gpt2",
)
MOE = ("qwen3_moe", "mixtral")

_ATTENTION = {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}
_COMMON = {**_ATTENTION, "intermediate_size": 96, "num_hidden_layers": 2, "max_position_embeddings": 512}
_IDS = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": None}
_ROPE_FACTORS = [1.0 + i / 16 for i in range(16)]  # head_dim / 2 of them
_LONG_ROPE_FACTORS = [1.0 + 6 * i / 15 for i in range(16)]  # up to 7, far from the short ones (as Phi-3's)


def _config(arch: str, vocab: int):
    import transformers as tf

    c = {**_COMMON, **_IDS, "vocab_size": vocab}
    if arch == "llama":
        llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
        rope = {"rope_type": "llama3", **llama3, "original_max_position_embeddings": 64, "rope_theta": 500000.0}
        return tf.LlamaConfig(**c, rope_parameters=rope, tie_word_embeddings=False)
    if arch in ("phi3", "phi3-su"):
        rope = {"rope_type": "longrope", "short_factor": _ROPE_FACTORS, "long_factor": _LONG_ROPE_FACTORS}
        rope |= {"original_max_position_embeddings": 64, "rope_theta": 10000.0}
        return tf.Phi3Config(**c, rope_parameters=rope, original_max_position_embeddings=64, tie_word_embeddings=False)
    if arch == "qwen2":
        return tf.Qwen2Config(**c, tie_word_embeddings=True)
    if arch == "qwen3":
        return tf.Qwen3Config(**c, tie_word_embeddings=True)
    if arch == "qwen3_moe":
        experts = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True}
        return tf.Qwen3MoeConfig(**c, **experts, decoder_sparse_step=1, tie_word_embeddings=False)
    if arch == "mixtral":
        return tf.MixtralConfig(**c, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    if arch == "gemma2":
        caps = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 32}
        return tf.Gemma2Config(**c, **caps, sliding_window=16, tie_word_embeddings=True)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(**c, sliding_window=16, query_pre_attn_scalar=32, tie_word_embeddings=True)
    if arch == "mistral":
        return tf.MistralConfig(**c, sliding_window=16, tie_word_embeddings=False)
    if arch == "gpt2":
        return tf.GPT2Config(n_embd=64, n_layer=2, n_head=2, n_positions=512, vocab_size=vocab, **_IDS)
    raise ValueError(f"Unknown architecture '{arch}'. Available: {', '.join(ARCHITECTURES)}.")


def _legacy_rope_keys(folder: Path, arch: str) -> None:
    """config.json as the family's checkpoints ship it: ``rope_theta`` and ``rope_scaling`` (Phi-3's
    first release: ``"type": "su"``, which transformers 5 refuses as it is: hybridrl.rope) instead of
    transformers 5's ``rope_parameters``."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters", None)
    if not rope:
        return
    cfg["rope_theta"] = rope.pop("rope_theta", 10000.0)
    kind = rope.pop("rope_type", "default")
    if kind != "default":
        cfg["rope_scaling"] = {"type": "su" if arch == "phi3-su" else kind, **rope}
        if kind == "longrope":  # Phi-3's and Phi-3.5's releases give the original length beside rope_scaling
            del cfg["rope_scaling"]["original_max_position_embeddings"]
        if kind == "llama3":  # Llama-3.1's key name
            cfg["rope_scaling"] = {"rope_type": kind, **rope}
    path.write_text(json.dumps(cfg, indent=2))


def build_checkpoint(path, arch: str, seed: int = 0) -> str:
    """A random 2-layer ``arch`` (one of ``ARCHITECTURES``) saved in ``path`` as real checkpoints
    ship (see the module's docstring); returns the folder."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from hybridrl_testing import SAMPLING_GENERATION_CONFIG, save_chat_tokenizer

    folder = Path(path)
    tokenizer = save_chat_tokenizer(folder)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch, len(tokenizer)))
    if arch in MOE:  # transformers' init leaves experts near zero; spread them so routing matters
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".experts." in name:
                    p.normal_(0, 0.1)
    if arch == "gemma2":  # scores that reach the attention's soft-cap, as a trained Gemma-2's do
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(8)
    model.generation_config = GenerationConfig(eos_token_id=[1, 0], pad_token_id=0, **SAMPLING_GENERATION_CONFIG)
    model.to(torch.bfloat16).save_pretrained(folder)
    _legacy_rope_keys(folder, arch)
    return str(folder)


LORA = {"r": 4, "alpha": 8, "target_modules": "all-linear"}


def two_grpo_steps(
    model: str,
    run_dir,
    engine: str = "hf",
    lora: bool | str = False,
    strategy: str = "single",
    data: dict | None = None,
    prompts: int = 2,
    sharding: dict | None = None,
    **rollout,
):
    """Train ``model`` for two GRPO steps (``prompts`` x 4 samples of up to 24 tokens, packed passes,
    the reward ``sevens`` of :class:`hybridrl_testing.SevensPlugin`, which the caller registers),
    checking the sync after each; returns the rows of its metrics.jsonl. ``data`` replaces the
    prompts (reasoning-gym's chain_sum), ``sharding`` adds to the strategy's options; ``lora``: True, or
    the ``model.lora.sync`` to train adapters with."""
    from hybridrl.config import load_config
    from hybridrl.run import build_run
    from hybridrl.trainer import Trainer

    chain_sum = {"source": "reasoning_gym", "task": "chain_sum", "size": 16, "chat_template": True}
    adapters = LORA | ({"sync": lora} if isinstance(lora, str) else {})
    cfg = {
        "model": {"path": model, **({"lora": adapters} if lora else {})},
        "data": data or chain_sum,
        "rollout": {"engine": engine, "n": 4, "max_tokens": 24, "sync_check_every": 1, **rollout},
        "rewards": [{"function": "sevens"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.01},
        "sharding": {"strategy": strategy, **(sharding or {})},
        "trainer": {"steps": 2, "prompts_per_step": prompts, "lr": 1e-2, "seed": 0, "run_dir": str(run_dir)},
        "logging": {"loggers": ["jsonl"]},
    }
    cfg["trainer"]["threads"] = 1
    cfg["trainer"]["pack_sequences"] = True
    Trainer(build_run(load_config(data=cfg))).train()
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
