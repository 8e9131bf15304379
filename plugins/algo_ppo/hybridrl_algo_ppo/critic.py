"""The critic: a transformer that outputs one value per position, and how to load it."""

from __future__ import annotations

import torch

from hybridrl import models


class ValueModel(torch.nn.Module):
    """A transformer with a scalar output per position: (B, L) -> (B, L) values.

    ``head=None``: the backbone is an ``AutoModelForTokenClassification`` with one label
    (verl's critic) and its logits are the values. Otherwise the backbone is a bare
    ``AutoModel`` and ``head`` a ``Linear(hidden, 1)`` on its last hidden states.
    """

    def __init__(self, backbone: torch.nn.Module, head: torch.nn.Linear | None = None):
        super().__init__()
        self.backbone = backbone
        self.head = head

    # what sharding strategies ask of a transformers model, answered by the backbone
    @property
    def _no_split_modules(self):
        return getattr(self.backbone, "_no_split_modules", None)

    @property
    def supports_gradient_checkpointing(self) -> bool:
        return getattr(self.backbone, "supports_gradient_checkpointing", False)

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.backbone.gradient_checkpointing_enable(**kwargs)

    @property
    def body(self) -> torch.nn.Module:
        """The transformer whose last hidden states the values read: the pass runner probes it once
        to see whether packed sequences stay apart in it (hybridrl.forward.ModelHandle)."""
        return self.backbone if self.head is not None else self.backbone.base_model

    def forward(self, input_ids: torch.Tensor, attention_mask=None, position_ids=None) -> torch.Tensor:
        """Padded rows (B, L) with their mask, or packed rows with their positions and no mask
        (:mod:`hybridrl.packing`) -> (B, L) values."""
        out = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=models.position_ids(attention_mask) if position_ids is None else position_ids,
            use_cache=False,
        )
        if self.head is None:
            return out.logits[..., 0]
        return self.head(out.last_hidden_state).squeeze(-1)


def load_value_model(
    path: str, arch: str, dtype: torch.dtype, vocab_size: int, trust_remote_code: bool = False
) -> ValueModel:
    """Build the critic from an HF folder (a causal LM, or a token-classification critic).

    ``value_head``: the folder's transformer without its LM head plus a new zero-initialised
    ``Linear(hidden, 1)`` (every value starts at 0). ``token_classification``:
    ``AutoModelForTokenClassification`` with one label; its head is loaded when the folder has
    one (a critic saved by verl), otherwise initialised by transformers; its dropout is off.
    """
    from transformers import AutoConfig, AutoModel, AutoModelForTokenClassification

    if arch == "token_classification":
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        config.num_labels = 1
        config.classifier_dropout = 0.0  # no dropout on a regression output (verl sets the same)
        backbone = AutoModelForTokenClassification.from_pretrained(
            path, config=config, dtype=dtype, trust_remote_code=trust_remote_code
        )
        head = None
    else:
        backbone = AutoModel.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
        hidden = backbone.config.get_text_config().hidden_size
        head = torch.nn.Linear(hidden, 1, dtype=dtype)
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
    critic_vocab = backbone.get_input_embeddings().num_embeddings
    if critic_vocab < vocab_size:
        raise ValueError(
            f"algorithm 'ppo': the critic at critic_path '{path}' has a vocabulary of {critic_vocab} tokens, "
            f"fewer than the policy tokenizer's {vocab_size}; the critic reads the policy's token ids. "
            "Use a critic built on the policy's tokenizer, or leave critic_path unset to start from the policy."
        )
    return ValueModel(backbone, head)
