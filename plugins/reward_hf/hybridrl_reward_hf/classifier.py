"""Sequence-classification models as rewards: reward models and cross-encoder rerankers."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from hybridrl.components import RewardFunction
from hybridrl_reward_hf.common import (
    ModelOptions,
    conversations,
    last_user_message,
    load_model_and_tokenizer,
    model_inputs,
    texts_of,
    unique,
)


class SequenceClassifier(RewardFunction):
    """An ``AutoModelForSequenceClassification`` turning texts (or text pairs) into one score each."""

    function = "sequence classifier"

    class Options(ModelOptions):
        truncation_side: Literal["left", "right"] = Field(
            "left",
            description="Which end of a too long input is cut: 'left' drops the start and keeps the end of the "
            "response (where decoder reward models read their score), 'right' drops the end. For a "
            "(prompt, response) pair the longer of the two is shortened first.",
        )
        label_index: int | None = Field(
            None, ge=0, description="Which output logit is the score; required when the model has several labels."
        )
        activation: Literal["none", "sigmoid", "softmax"] = Field(
            "none",
            description="Logit -> score: none (the raw logit), sigmoid (a probability), softmax (the probability "
            "of label_index among the labels).",
        )

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        from transformers import AutoModelForSequenceClassification

        self.component = f"reward function '{self.function}'"
        self.tokenizer, self.model, self.device = load_model_and_tokenizer(
            AutoModelForSequenceClassification, options, ctx, self.component
        )
        self.tokenizer.truncation_side = options.truncation_side
        if self.tokenizer.pad_token is None:  # decoder reward models often have none
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if getattr(self.model.config, "pad_token_id", None) is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.label = self._check_label()

    def _check_label(self) -> int:
        o, n = self.options, self.model.config.num_labels
        labels = ", ".join(f"{i}: {name}" for i, name in sorted((self.model.config.id2label or {}).items()))
        if o.label_index is None and n > 1:
            raise ValueError(f"{self.component}: model '{o.model}' has {n} labels ({labels}); set label_index.")
        index = o.label_index or 0
        if index >= n:
            raise ValueError(
                f"{self.component}: label_index is {index}, but model '{o.model}' has {n} label(s) ({labels})."
            )
        if o.activation == "softmax" and n == 1:
            raise ValueError(f"{self.component}: activation softmax over one label is always 1; use none or sigmoid.")
        return index

    def encode(self, first: list[str], second: list[str] | None = None, add_special_tokens: bool = True):
        """Tokenize texts (or text pairs) with this model's own tokenizer, padded and truncated."""
        return self.tokenizer(
            first,
            second,
            padding=True,
            truncation="longest_first" if second is not None else True,
            max_length=self.options.max_length,
            add_special_tokens=add_special_tokens,
            return_tensors="pt",
        )

    @torch.no_grad()
    def classify(self, first: list[str], second: list[str] | None = None, add_special_tokens: bool = True):
        """(B,) scores of texts or text pairs; each distinct input is run once, batch_size at a time."""
        keys, index = unique(list(zip(first, second)) if second is not None else list(first))
        out = []
        size = self.options.batch_size
        for start in range(0, len(keys), size):
            part = keys[start : start + size]
            a = [k[0] for k in part] if second is not None else part
            b = [k[1] for k in part] if second is not None else None
            enc = self.encode(a, b, add_special_tokens)
            logits = self.model(**model_inputs(enc, self.model, self.device)).logits.float()  # (b, labels)
            out.append(self._activate(logits).cpu())
        return torch.cat(out)[index] if out else torch.zeros(0)

    def _activate(self, logits: torch.Tensor) -> torch.Tensor:  # (b, labels) -> (b,)
        act = self.options.activation
        if act == "sigmoid":
            logits = torch.sigmoid(logits)
        elif act == "softmax":
            logits = torch.softmax(logits, dim=-1)
        return logits[:, self.label]

    def close(self) -> None:
        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


class RewardModel(SequenceClassifier):
    """A classic reward model: the conversation plus the response, with the reward model's own template."""

    function = "reward_model"

    class Options(SequenceClassifier.Options):
        template: Literal["auto", "chat", "pair"] = Field(
            "auto",
            description="How the input is built: chat = the reward model's own chat template over the "
            "conversation and the response; pair = (last user message, response) as a text pair; auto = chat "
            "when the reward model's tokenizer has a chat template, else pair.",
        )

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.mode = options.template
        if self.mode == "auto":
            self.mode = "chat" if self.tokenizer.chat_template else "pair"
        if self.mode == "chat" and not self.tokenizer.chat_template:
            raise ValueError(
                f"{self.component}: template is 'chat', but the tokenizer of '{options.model}' has no chat "
                "template. Use template: pair (or auto)."
            )

    def inputs(self, batch) -> tuple[list[str], list[str] | None, bool]:
        """What the model reads: (texts, None, add_special_tokens) or (prompts, responses, True)."""
        convs, responses = conversations(batch, self.component), list(batch["response_text"])
        if self.mode == "pair":
            return [last_user_message(c) for c in convs], responses, True
        tok = self.tokenizer
        texts = [
            tok.apply_chat_template(c + [{"role": "assistant", "content": r}], tokenize=False)
            for c, r in zip(convs, responses)
        ]
        # the template usually writes the BOS/CLS token itself; add the tokenizer's only when it does not
        starts = [t for t in (tok.bos_token, tok.cls_token) if t]
        return texts, None, not any(texts[0].startswith(t) for t in starts) if texts else True

    def score(self, batch):
        return self.classify(*self.inputs(batch))


class Reranker(SequenceClassifier):
    """A cross-encoder reranker as a reward: relevance of (query, response)."""

    function = "reranker"

    class Options(SequenceClassifier.Options):
        activation: Literal["none", "sigmoid", "softmax"] = Field(
            "sigmoid", description="Logit -> score: sigmoid (relevance in [0, 1]), none (the raw logit), softmax."
        )
        query: str = Field(
            "prompt",
            pattern=r"^(prompt|answer|metadata\..+)$",
            description="The query: prompt (the last user message), answer (the reference answer) or "
            "metadata.KEY (a field of the row's metadata). The passage is the response.",
        )
        subtract_reference: bool = Field(
            False,
            description="Score minus the score of the reference answer for the same query: positive when the "
            "response is more relevant than the reference (needs data.answer_column).",
        )

        @model_validator(mode="after")
        def _check(self):
            if self.subtract_reference and self.query == "answer":
                raise ValueError("subtract_reference compares against the answer, so query cannot be 'answer'.")
            return self

    def score(self, batch):
        o = self.options
        queries = texts_of(batch, o.query, self.component, "query")
        scores = self.classify(queries, list(batch["response_text"]))
        if o.subtract_reference:
            answers = texts_of(batch, "answer", self.component, "subtract_reference")
            scores = scores - self.classify(queries, answers)
        return scores
