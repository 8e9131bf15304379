"""Prompts: which row of the prompt source comes next, and how a row becomes a prompt."""

from __future__ import annotations

import sys

import torch

from hybridrl import distributed
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


def field(row: dict, path: str):
    """The row's field ``path``: a key of the row, or a dotted path into its nested mappings
    (``reward_model.ground_truth``); KeyError when a part is missing."""
    if path in row:
        return row[path]
    value = row
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(path)
        value = value[part]
    return value


def has_field(row: dict, path: str) -> bool:
    try:
        field(row, path)
    except KeyError:
        return False
    return True


def fields(row: dict, prefix: str = "") -> list[str]:
    """Every field of a row, nested ones as dotted paths: what an error lists."""
    out = []
    for key, value in row.items():
        out.append(prefix + key)
        if isinstance(value, dict):
            out += fields(value, f"{prefix}{key}.")
    return out


#: data.prompt_column: auto takes the first field of these that the rows have (TRL's and verl's
#: column, then reasoning-gym's); a row that has neither keeps the key 'auto' (hybridrl serve's rows)
PROMPT_FIELDS = ("prompt", "question")
#: data.answer_column: auto takes the first of these the rows have (verl's ground truth second), else none
ANSWER_FIELDS = ("answer", "reward_model.ground_truth")


def prompt_column(row: dict, data_cfg) -> str:
    """The field of ``row`` that holds its prompt: data.prompt_column, ``auto`` resolved."""
    col = data_cfg.prompt_column
    if col != "auto":
        return col
    return next((c for c in PROMPT_FIELDS if c in row), col)


def answer_column(row: dict, data_cfg) -> str | None:
    """The field of ``row`` that holds the ground truth given to rewards, or None."""
    col = data_cfg.answer_column
    if col != "auto":
        return col
    return next((c for c in ANSWER_FIELDS if has_field(row, c)), None)


def row_answer(row: dict, data_cfg):
    """The ground truth of ``row`` (``batch["answer"]``): its answer column's value, or None."""
    col = answer_column(row, data_cfg)
    return field(row, col) if col is not None and has_field(row, col) else None


def prompt_messages(row: dict, data_cfg) -> list[dict]:
    """The chat messages of a row: the prompt column (text through data.template, or messages)."""
    col = prompt_column(row, data_cfg)
    value = field(row, col)
    if value is None or (isinstance(value, str | list) and not value):
        raise ConfigError(
            f"data: a row's prompt (field '{col}') is {value!r}; every row needs one. Drop such "
            f"rows from the data, or set data.prompt_column to another of the row's fields: {', '.join(row)}."
        )
    if isinstance(value, list):  # already chat messages
        messages = list(value)
    else:
        try:  # the prompt field by its name too: template '{question}' works as '{prompt}' does
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
    """The source has rows, and the prompt and answer columns the run config names exist in them
    (dotted paths into nested fields too); says which field ``auto`` chose where the rows have several."""
    if len(source) == 0:
        raise ConfigError(
            f"data: the prompt source '{cfg.data.source}' yields no prompts. Check its options (file, split, "
            "task, size) in the data section."
        )
    row = source[0]
    names = fields(row)
    if cfg.data.prompt_column == "auto":
        found = [c for c in PROMPT_FIELDS if c in row]
        if not found:
            raise ConfigError(
                f"data.prompt_column is auto, but the rows have neither {' nor '.join(PROMPT_FIELDS)}. "
                f"Fields: {', '.join(names)}. Set data.prompt_column to the field that holds the prompt."
            )
        if len(found) > 1 and distributed.is_main():
            print(
                f"data: the rows have {' and '.join(found)}; prompts come from '{found[0]}' "
                f"(data.prompt_column: auto). Set data.prompt_column to choose another.",
                file=sys.stderr,
            )
    for key in ("prompt_column", "answer_column"):
        col = getattr(cfg.data, key)
        if col not in (None, "auto") and not has_field(row, col):
            raise ConfigError(
                f"data.{key} is '{col}', but the rows have no such field. "
                f"Fields: {', '.join(names)}. Set data.{key} to one of them."
            )


def check_reward_fields(row: dict, data_cfg, rewards, where: str, key: str) -> None:
    """Each reward of ``rewards`` (their configs) finds in ``row`` the fields it reads beside the prompt
    and the response (:meth:`~hybridrl.components.RewardFunction.needs`). ``key``: the section the rows
    come from (``data``, ``data.eval[0]``); ``where``: how errors name it."""
    from hybridrl import plugins

    have = {"answer": row_answer(row, data_cfg) is not None, "metadata": row.get("metadata") is not None}
    for rc in rewards:
        needs = plugins.lookup("reward function", rc.function).needs(rc.options)
        missing = sorted(f for f in needs if not have.get(f, has_field(row, f)))
        if not missing:
            continue
        fix = (
            f"set {key}.answer_column to the field with the ground truth"
            if "answer" in missing
            else "use the prompt source the reward is made for"
        )
        if key == "data":
            rows, other = "the rows", "use rewards that do not read it"
        else:
            rows, other = "the set's rows", f"give the set rewards of its own ({key}.rewards)"
        raise ConfigError(
            f"{where}: reward '{rc.label}' (function '{rc.function}') reads the rows' {' and '.join(missing)}, "
            f"which {rows} do not have (fields: {', '.join(fields(row))}). Either {fix}, or {other}."
        )


def longest_prompt(source, data_cfg, tokenizer, rows: int = 256) -> int:
    """Tokens of the longest prompt of the source's first ``rows`` rows, each built as the run builds it
    (template, system prompt, chat template): a template field the rows lack, a tokenizer without a chat
    template or a prompt over data.max_prompt_tokens is found here, before any model loads."""
    if data_cfg.chat_template and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "data.chat_template is true, but the model's tokenizer has no chat template. Set "
            "data.chat_template: false to give the prompts as plain text, or use a chat model's folder."
        )
    return max(len(encode_prompt(source[i], data_cfg, tokenizer)[0]) for i in range(min(len(source), rows)))
