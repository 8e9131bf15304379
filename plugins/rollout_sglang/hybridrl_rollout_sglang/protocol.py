"""SGLang's native request and output formats as pure functions: no engine, no network.

The same request serves both modes: it is the JSON body of a server's ``/generate`` and the
keyword arguments of ``sglang.Engine.generate``::

    {"input_ids": [[...], ...], "sampling_params": {...} or [{...}, ...], "return_logprob": true}

Each request answers with one dict (a list of them for a batch)::

    {"text": "...",                       # absent when the tokenizer is skipped
     "output_ids": [id, ...],
     "meta_info": {"finish_reason": {"type": "stop", "matched": 2}   # or {"type": "length",
                                                                      #  "length": 16}
                   "output_token_logprobs": [[logprob, id, null], ...],   # tuples in-process
                   "prompt_tokens": 12, "completion_tokens": 16, ...}}

SGLang's logprobs (``sglang/srt/layers/sampler.py``, 0.5.x): the logits are divided by the
temperature, softmaxed over the whole vocabulary, the token is sampled with top-k/top-p
applied inside the sampling kernel, and the returned logprob is ``log(probs)`` of the full
temperature-scaled distribution. That is hybridrl's convention (the trainer's
``response_logprobs(..., temperature)``), so the values are used as they are. Two exceptions:
``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` makes SGLang return logprobs before the temperature
(checked in-process), and temperature 0 (greedy) returns the raw log-softmax; the core
requires a temperature > 0.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Callable, Iterable
from pathlib import Path

from hybridrl.components import NEUTRAL_SAMPLING, RolloutOutput, SamplingParams
from hybridrl.engines import stop_length

COMPONENT = "sglang rollout engine"
LOGPROB_SLACK = 1e-4  # a log-probability is at most 0; float rounding may put one a hair above


class SGLangOutputError(RuntimeError):
    """SGLang answered something this plugin cannot turn into a rollout; the message says what."""


# -- requests -------------------------------------------------------------------------------


def sampling_params(sampling: SamplingParams, stop_token_ids: Iterable[int], *, stop_in_engine: bool = False) -> dict:
    """SGLang ``sampling_params`` for one sample (``n`` is handled by repeating prompts).

    Every parameter that changes the distribution is sent explicitly: SGLang otherwise takes
    defaults from the model's ``generation_config.json`` (``--sampling-defaults model``), and
    a ``repetition_penalty`` or ``top_k`` from there would make the returned logprobs differ
    from the trainer's.
    """
    ignore_eos = bool(getattr(sampling, "ignore_eos", False))  # generate exactly max_tokens
    params = {
        "max_new_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        **NEUTRAL_SAMPLING,
        "stop_token_ids": [] if ignore_eos else sorted(set(stop_token_ids)),
        "ignore_eos": ignore_eos,
        "no_stop_trim": True,  # keep the stop token in output_ids: it is part of the response
    }
    if stop_in_engine and sampling.stop:
        params["stop"] = list(sampling.stop)
    return params


def generate_request(
    prompts: list[list[int]],
    sampling: SamplingParams,
    stop_token_ids: Iterable[int],
    *,
    stop_in_engine: bool = False,
    per_request_seed: bool = False,
) -> dict:
    """The ``/generate`` body for P prompts x n samples, one request per sample, grouped by prompt.

    SGLang's docs advise repeating prompts over ``n > 1`` (its radix cache shares the prompt).
    With ``per_request_seed`` each sample gets its own ``sampling_seed`` (seed + row), so the
    n copies of a prompt do not draw the same sample.
    """
    ids = [[int(t) for t in p] for p in prompts for _ in range(sampling.n)]
    params = sampling_params(sampling, stop_token_ids, stop_in_engine=stop_in_engine)
    seeds = sampling.sample_seeds(len(prompts)) if per_request_seed else None
    if seeds is not None:
        params = [{**params, "sampling_seed": seed} for seed in seeds]
    return {"input_ids": ids, "sampling_params": params, "return_logprob": True}


def split_request(request: dict, size: int) -> list[dict]:
    """Cut a request into requests of at most ``size`` rows (0: keep it whole)."""
    rows = len(request["input_ids"])
    if not size or rows <= size:
        return [request]
    parts = []
    for start in range(0, rows, size):
        part = dict(request, input_ids=request["input_ids"][start : start + size])
        for key in ("sampling_params", "lora_path"):  # per row where they are lists
            if isinstance(request.get(key), list):
                part[key] = request[key][start : start + size]
        parts.append(part)
    return parts


# -- outputs --------------------------------------------------------------------------------


def parse_output(item: dict, row: int = 0) -> tuple[list[int], list[float], str]:
    """Token ids, their logprobs and "stop"/"length" from one SGLang output dict.

    The ids are read from ``meta_info.output_token_logprobs`` (one entry per sampled token,
    the stop token included) and checked against ``output_ids``, which may lack a trimmed
    stop token.
    """
    where = f"{COMPONENT}: output {row}"
    if not isinstance(item, dict):
        raise SGLangOutputError(f"{where} is {type(item).__name__}, not a dict with output_ids and meta_info.")
    meta = item.get("meta_info") or {}
    finish = meta.get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "abort":
        raise SGLangOutputError(
            f"{where} was aborted by SGLang: {finish.get('message', finish)}. A prompt longer than the "
            "engine's context_length, or a server restart, aborts requests."
        )
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise SGLangOutputError(
            f"{where} has no meta_info.output_token_logprobs (keys: {sorted(meta)}). The request must "
            "set return_logprob=true; a proxy in front of SGLang may drop it."
        )
    ids, logprobs = [], []
    for k, entry in enumerate(entries):
        logprob, token = entry[0], entry[1]
        if logprob is None:
            raise SGLangOutputError(f"{where}: token {k} ({token}) has no logprob.")
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
            raise SGLangOutputError(f"{where}: token {k} is {str(token)[:50]}, not a token id.")
        if isinstance(logprob, bool) or not isinstance(logprob, numbers.Real) or not math.isfinite(logprob):
            raise SGLangOutputError(f"{where}: token {k} ({token}) has logprob {str(logprob)[:50]}, not a number.")
        if logprob > LOGPROB_SLACK:
            raise SGLangOutputError(
                f"{where}: token {k} ({token}) has logprob {logprob:g}, above 0: not a log-probability (a server "
                "returning logits, or a proxy rewriting them). hybridrl needs SGLang's own return_logprob values."
            )
        ids.append(int(token))
        logprobs.append(float(logprob))
    output_ids = [int(t) for t in item.get("output_ids", ids)]
    if output_ids != ids and output_ids != ids[:-1]:
        raise SGLangOutputError(
            f"{where}: output_ids ({len(output_ids)} tokens) disagree with output_token_logprobs "
            f"({len(ids)} tokens): {output_ids[:8]}... vs {ids[:8]}..."
        )
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind not in ("stop", "length"):
        raise SGLangOutputError(f"{where} has finish_reason {finish!r}; expected type 'stop' or 'length'.")
    return ids, logprobs, kind


def to_rollout_output(
    items: list[dict],
    expected: int,
    stops: list[str] = (),
    decode: Callable[[list[int]], str] | None = None,
) -> RolloutOutput:
    """SGLang outputs -> :class:`RolloutOutput`; responses are cut after a stop string."""
    if len(items) != expected:
        raise SGLangOutputError(f"{COMPONENT}: SGLang returned {len(items)} outputs for {expected} requests.")
    out = RolloutOutput([], [], [])
    for row, item in enumerate(items):
        ids, logprobs, finish = parse_output(item, row)
        end = stop_length(ids, decode, list(stops)) if decode is not None else None
        if end is not None:
            ids, logprobs, finish = ids[:end], logprobs[:end], "stop"
        out.token_ids.append(ids)
        out.logprobs.append(logprobs)
        out.finish_reasons.append(finish)
    return out


# -- weights ----------------------------------------------------------------------------------


def model_facts(model_path: str, tokenizer) -> tuple[set[int], bool]:
    """The token ids that end a response, and whether the LM head is tied to the embeddings.

    End ids: the tokenizer's EOS plus the ``eos_token_id`` of ``generation_config.json`` and
    of the model config. With tied embeddings ``lm_head.weight`` is not sent: SGLang's
    loaders skip it, and safetensors refuses a tensor saved twice.
    """
    from transformers import AutoConfig

    eos: set[int] = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    config = AutoConfig.from_pretrained(model_path)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    tied = bool(getattr(text, "tie_word_embeddings", False))
    values = [getattr(text, "eos_token_id", None)]
    gen = Path(model_path) / "generation_config.json"
    if gen.is_file():
        values.append(json.loads(gen.read_text()).get("eos_token_id"))
    for value in values:
        if value is not None:
            eos.update(int(v) for v in (value if isinstance(value, list) else [value]))
    return eos, tied
