"""Cosine similarity of the response and a reference, with a sentence-transformers encoder.

The encoder is run with plain transformers: the token embeddings of the model folder are
pooled as its sentence-transformers pooling config says (``modules.json`` ->
``1_Pooling/config.json``), so no sentence-transformers install is needed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field

from hybridrl.components import RewardFunction
from hybridrl_reward_hf.common import (
    ModelOptions,
    load_model_and_tokenizer,
    model_inputs,
    resolve_model,
    texts_of,
    unique,
)

POOLINGS = ("cls", "mean", "max", "mean_sqrt_len", "lasttoken")
ST_POOLING = {  # sentence-transformers' Pooling config keys
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_lasttoken": "lasttoken",
}


def read_pooling(folder: str) -> tuple[str | None, int | None]:
    """(pooling mode, max_seq_length) from a sentence-transformers folder; None where it says nothing."""
    root = Path(folder)
    if not root.is_dir():
        return None, None
    max_len = None
    bert_cfg = root / "sentence_bert_config.json"
    if bert_cfg.is_file():
        max_len = json.loads(bert_cfg.read_text()).get("max_seq_length")
    modules = root / "modules.json"
    if not modules.is_file():
        return None, max_len
    for module in json.loads(modules.read_text()):
        if module.get("type", "").endswith("Pooling"):
            cfg = json.loads((root / module.get("path", "") / "config.json").read_text())
            modes = [ST_POOLING.get(k, k) for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
            if len(modes) != 1 or modes[0] not in POOLINGS:
                raise ValueError(
                    f"{folder}: pooling {modes or 'none'} is not supported (supported: one of {', '.join(POOLINGS)}). "
                    "Set pooling explicitly."
                )
            return modes[0], max_len
    return None, max_len


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Sentence embeddings from token embeddings: (B, L, H), (B, L) -> (B, H)."""
    m = mask.unsqueeze(-1).to(hidden.dtype)  # (B, L, 1)
    if mode == "cls":
        return hidden[:, 0]
    if mode in ("mean", "mean_sqrt_len"):
        total, count = (hidden * m).sum(1), m.sum(1).clamp(min=1e-9)
        return total / (count if mode == "mean" else count.sqrt())
    if mode == "max":
        return hidden.masked_fill(m == 0, torch.finfo(hidden.dtype).min).max(1).values
    if mode == "lasttoken":  # the last real token, for right or left padding
        last = (mask * torch.arange(mask.shape[1], device=mask.device)).argmax(-1)  # (B,)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    raise ValueError(f"Unknown pooling '{mode}'. Available: {', '.join(POOLINGS)}.")


class EmbeddingSimilarity(RewardFunction):
    """Cosine similarity in [-1, 1] between the response and a reference text (the answer by default)."""

    function = "embedding_similarity"

    class Options(ModelOptions):
        max_length: int | None = Field(
            None, gt=0, description="Tokens per text; default: the model's max_seq_length (sentence-transformers)."
        )
        pooling: Literal["auto", "cls", "mean", "max", "mean_sqrt_len", "lasttoken"] = Field(
            "auto",
            description="Token embeddings -> sentence embedding; auto = what the model's sentence-transformers "
            "pooling config says (mean when it has none).",
        )
        reference: str = Field(
            "answer",
            pattern=r"^(answer|prompt|metadata\..+)$",
            description="What the response is compared with: answer (the ground truth), prompt (the last user "
            "message) or metadata.KEY.",
        )
        response_prefix: str = Field("", description="Put before each response (e.g. 'query: ' for E5 models).")
        reference_prefix: str = Field("", description="Put before each reference (e.g. 'passage: ').")

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        from transformers import AutoModel

        self.component = f"reward function '{self.function}'"
        self.tokenizer, self.model, self.device = load_model_and_tokenizer(AutoModel, options, ctx, self.component)
        mode, max_len = read_pooling(resolve_model(options.model, self.component))
        self.pooling = (mode or "mean") if options.pooling == "auto" else options.pooling
        self.max_length = options.max_length or max_len or 512

    @torch.no_grad()
    def embed(self, texts: list[str]) -> torch.Tensor:
        """(N, H) unit-length embeddings, each distinct text encoded once, batch_size at a time."""
        keys, index = unique(list(texts))
        out = []
        size = self.options.batch_size
        for start in range(0, len(keys), size):
            enc = self.tokenizer(
                keys[start : start + size],
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            )
            inputs = model_inputs(enc, self.model, self.device)
            hidden = self.model(**inputs).last_hidden_state.float()  # (b, L, H)
            emb = pool(hidden, inputs["attention_mask"], self.pooling)
            out.append(torch.nn.functional.normalize(emb, dim=-1).cpu())
        return torch.cat(out)[index]

    def score(self, batch):
        o = self.options
        refs = texts_of(batch, o.reference, self.component, "reference")
        responses = [o.response_prefix + r for r in batch["response_text"]]
        emb = self.embed(responses + [o.reference_prefix + r for r in refs])
        a, b = emb[: len(responses)], emb[len(responses) :]
        return (a * b).sum(-1)

    def close(self) -> None:
        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
