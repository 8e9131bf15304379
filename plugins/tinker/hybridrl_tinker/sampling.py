"""What a sampling call asks for, as the engine takes it: the sampler (a sampling session's
weights), the prompt's tokens, the sampling settings."""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.components import SamplingParams
from hybridrl_tinker.futures import UserError


@dataclass
class Sampler:
    """A sampling session: the base (``tensors`` None and no ``path``), a saved folder, or a snapshot."""

    base_model: str
    path: str | None = None
    tensors: dict | None = None
    model_id: str | None = None
    expired: bool = False


def prompt_tokens(prompt) -> list[int]:
    """A ModelInput's tokens: its encoded_text chunks, in order; images are not served."""
    if not isinstance(prompt, dict) or not isinstance(prompt.get("chunks"), list):
        raise UserError("prompt must be a ModelInput: {'chunks': [{'type': 'encoded_text', 'tokens': [...]}]}")
    tokens = []
    for chunk in prompt["chunks"]:
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            raise UserError("only encoded_text chunks are served (no images or audio)")
        ids = chunk.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise UserError("an encoded_text chunk's tokens must be a list of token ids")
        tokens += ids
    if not tokens:
        raise UserError("the prompt is empty")
    return tokens


def sampling_params(params: dict, n: int, tokenizer, config) -> SamplingParams:
    """The SDK's SamplingParams as the engine's: top_k -1 is off (0 here), temperature 0 is greedy
    (top_k 1), stop token ids become their text, an empty stop list samples past end of sequence,
    no max_tokens is the run config's rollout.max_tokens."""
    temperature, top_k = float(params.get("temperature", 1.0)), int(params.get("top_k", -1))
    if temperature <= 0:
        temperature, top_k = 1.0, 1
    stop, ignore_eos = params.get("stop"), False
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif stop == []:
        ignore_eos = True
    elif all(isinstance(s, int) for s in stop):
        stop = [tokenizer.decode([s]) for s in stop]
    max_tokens = params.get("max_tokens") or config.rollout.max_tokens
    try:
        return SamplingParams(n=n, temperature=temperature, top_p=float(params.get("top_p", 1.0)),
                              top_k=max(0, top_k), max_tokens=max_tokens, stop=stop, ignore_eos=ignore_eos,
                              seed=params.get("seed"))  # fmt: skip
    except ValueError as e:
        raise UserError(f"sampling_params: {e}") from None
