"""Prompts: which row of the prompt source comes next, and how a row becomes a prompt."""

from __future__ import annotations

import torch

from hybridrl.errors import ConfigError


class PromptOrder:
    """Which row comes next: a seeded permutation per epoch and a position, so it can resume."""

    def __init__(self, size: int, seed: int, shuffle: bool = True):
        if size == 0:
            raise ValueError("data: the prompt source has no rows.")
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch, self.pos = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.size))
        return torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.pos == self.size:
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._permutation()
            out.append(self._order[self.pos])
            self.pos += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._permutation()


def prompt_messages(row: dict, data_cfg) -> list[dict]:
    """The chat messages of a row: the prompt column (text through data.template, or messages)."""
    value = row[data_cfg.prompt_column]
    if value is None or (isinstance(value, str | list) and not value):
        raise ConfigError(
            f"data: a row's prompt (field '{data_cfg.prompt_column}') is {value!r}; every row needs one. Drop such "
            f"rows from the data, or set data.prompt_column to another of the row's fields: {', '.join(row)}."
        )
    if isinstance(value, list):  # already chat messages
        messages = list(value)
    else:
        try:
            content = data_cfg.template.format(**{**row, "prompt": value})
        except KeyError as e:
            raise ConfigError(
                f"data.template uses {{{e.args[0]}}}, which rows do not have. Row fields: {', '.join(row)}."
            ) from None
        messages = [{"role": "user", "content": content}]
    if data_cfg.system_prompt and not any(m.get("role") == "system" for m in messages):
        messages = [{"role": "system", "content": data_cfg.system_prompt}] + messages
    return messages


def encode_prompt(row: dict, data_cfg, tokenizer, tools: list[dict] | None = None) -> tuple[list[int], str]:
    """Token ids and text of the prompt for a row: template, system prompt, chat template (with the
    schemas of the agent's ``tools``, which templates that support tools show the model)."""
    messages = prompt_messages(row, data_cfg)
    if data_cfg.chat_template:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        text = "\n".join(m["content"] for m in messages)
        ids = tokenizer(text)["input_ids"]
    if len(ids) > data_cfg.max_prompt_tokens:
        raise ConfigError(
            f"A prompt has {len(ids)} tokens, more than data.max_prompt_tokens="
            f"{data_cfg.max_prompt_tokens}. Raise it or shorten the template: {text[:80]!r}..."
        )
    return ids, text


def check_columns(source, cfg) -> None:
    """The source has rows, and the prompt and answer columns the run config names exist in them."""
    if len(source) == 0:
        raise ConfigError(
            f"data: the prompt source '{cfg.data.source}' yields no prompts. Check its options (file, split, "
            "task, size) in the data section."
        )
    columns = getattr(source, "columns", None) or list(source[0])
    for key in ("prompt_column", "answer_column"):
        col = getattr(cfg.data, key)
        if col is not None and col not in columns:
            raise ConfigError(
                f"data.{key} is '{col}', but the rows have no such field. "
                f"Fields: {', '.join(columns)}. Set data.{key} to one of them."
            )
