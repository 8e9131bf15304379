"""What the model rewards share: finding the model, its device, and the texts to score."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field

from hybridrl.components import Options
from hybridrl.devices import resolve_device
from hybridrl.models import DTYPES, locate


class ModelOptions(Options):
    """Options of every reward that runs a Hugging Face model."""

    model: str = Field(
        description="A local Hugging Face model folder; 'package:NAME' or 'package:NAME/sub/folder' for a model "
        "shipped in an installed Python package; or a hub name already in the local Hugging Face cache "
        "(nothing is downloaded unless the environment allows it)."
    )
    device: str = Field(
        "auto",
        description="Where this model runs, independently of the policy: 'auto' (the policy's device), 'cpu', "
        "'cuda', 'cuda:1' (e.g. a second GPU for the reward model)...",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Parameter dtype of the model.")
    batch_size: int = Field(16, gt=0, description="Texts per forward pass.")
    max_length: int = Field(512, gt=0, description="Longer inputs are truncated to this many tokens.")
    trust_remote_code: bool = Field(False, description="Allow custom model code shipped with the checkpoint.")


def resolve_model(path: str, component: str) -> str:
    """A folder (or a hub name) that ``from_pretrained`` takes, for ``model: path``."""
    if path.startswith("package:"):
        package, _, sub = path[len("package:") :].partition("/")
        try:
            folder = locate(f"package:{package}") / sub
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{component}: {str(e).replace('model.path', 'model')}") from None
        if not folder.is_dir():
            raise FileNotFoundError(f"{component}: model '{path}': the package has no folder '{sub}'.")
        return str(folder)
    if Path(path).expanduser().exists():
        return str(Path(path).expanduser())
    if path.startswith((".", "/", "~")) or path.count("/") != 1:
        raise FileNotFoundError(
            f"{component}: model '{path}' does not exist. Give a local Hugging Face model folder, "
            "'package:NAME/folder', or a hub name (org/model) that is in the local cache."
        )
    return path  # a hub name: from_pretrained looks in the local cache


def load_pretrained(loader, path: str, component: str, **kwargs):
    """``loader.from_pretrained(path)`` with an error that says which component and what to do."""
    try:
        return loader.from_pretrained(path, **kwargs)
    except OSError as e:
        raise FileNotFoundError(
            f"{component}: could not load model '{path}' ({str(e).splitlines()[0]}). Give a local folder, or put "
            "the model in the Hugging Face cache beforehand: models are not downloaded at run time here."
        ) from None


def load_model_and_tokenizer(auto_model, options: ModelOptions, ctx, component: str):
    """The tokenizer and the eval-mode, frozen model of a reward, on its own device."""
    from transformers import AutoTokenizer

    policy = ctx.device if ctx is not None and ctx.device is not None else torch.device("cpu")
    device = resolve_device(
        options.device, f"{component}: device", auto=policy, fix="Set this reward's device to cpu or auto"
    )
    path = resolve_model(options.model, component)
    tokenizer = load_pretrained(AutoTokenizer, path, component, trust_remote_code=options.trust_remote_code)
    model = load_pretrained(
        auto_model, path, component, dtype=DTYPES[options.dtype], trust_remote_code=options.trust_remote_code
    )
    model = model.to(device).eval().requires_grad_(False)
    return tokenizer, model, device


def model_inputs(encoding, model, device: torch.device) -> dict:
    """Tokenizer output as forward() arguments: token type ids only where the model has segments."""
    inputs = {k: v.to(device) for k, v in encoding.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    if getattr(model.config, "type_vocab_size", 0) <= 1:
        inputs.pop("token_type_ids", None)
    return inputs


# -- the texts of a batch -------------------------------------------------------------------

_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        print(f"warning: {message}", file=sys.stderr, flush=True)


def conversations(batch, component: str) -> list[list[dict]]:
    """The chat messages of each row's prompt (without the response).

    ``batch["messages"]`` when the trainer provides it; otherwise the policy's chat-templated
    ``prompt_text`` becomes one user message (with a warning: the policy's template markers
    are then part of what the reward model reads).
    """
    if "messages" in batch:
        return [list(m) for m in batch["messages"]]
    warn_once(
        f"{component}:messages",
        f"{component}: the batch has no 'messages' (each prompt's chat messages), so the policy's "
        "chat-templated prompt text is used as the user message; the reward model then also reads the "
        "policy's template markers.",
    )
    return [[{"role": "user", "content": text}] for text in batch["prompt_text"]]


def last_user_message(messages: list[dict]) -> str:
    for m in reversed(messages):
        if m.get("role") == "user":
            return str(m.get("content", ""))
    return str(messages[-1].get("content", "")) if messages else ""


def texts_of(batch, spec: str, component: str, key: str) -> list[str]:
    """The strings a reward reads for ``spec``: prompt, response, answer or metadata.KEY."""
    if spec == "prompt":
        return [last_user_message(m) for m in conversations(batch, component)]
    if spec == "response":
        return list(batch["response_text"])
    if spec == "answer":
        values = batch["answer"]
        if any(v is None for v in values):
            raise ValueError(
                f"{component}: {key}=answer needs the ground truth, but rows have no answer: set data.answer_column "
                "to the field that holds it."
            )
        return [str(v) for v in values]
    if spec.startswith("metadata."):
        field = spec.split(".", 1)[1]
        out = []
        for meta in batch["metadata"]:
            if not isinstance(meta, dict) or field not in meta:
                have = ", ".join(meta) if isinstance(meta, dict) else "no metadata"
                raise ValueError(f"{component}: {key}={spec}, but a row's metadata has no '{field}' (it has: {have}).")
            out.append(str(meta[field]))
        return out
    raise ValueError(f"{component}: {key} is '{spec}'; use prompt, response, answer or metadata.KEY.")


def unique(items: list) -> tuple[list, list[int]]:
    """The distinct items in first-seen order, and each item's index among them."""
    first: dict = {}
    index = [first.setdefault(item, len(first)) for item in items]
    return list(first), index
