"""The OpenAI chat completions surface of ``hybridrl serve``: which request keys it takes, why it
refuses the others, and its replies in OpenAI's shape (docs/online.md, "Request keys").

Each key of a request is one of:

- **answered**: honoured as OpenAI documents it (:data:`ANSWERED`);
- **ignored**: it changes nothing in the answer or in what is stored and trained on: who asks,
  tags, billing and caching hints (:data:`IGNORED`);
- **the run's sampling**: the config fixes how answers are sampled, because the trainer scores
  what the engine sampled (token in, token out). A sampling key passes only with the value the
  run samples with (``temperature: 1`` when ``rollout.temperature`` is 1), so an agent that sends
  the defaults works and one that asks for other sampling learns that it does not get it;
- **refused**: everything else, with 400 naming the key and saying why (:data:`REFUSED`), never
  ignored: an agent that sends ``tools`` and gets prose back would fail far from the cause.

``null`` is OpenAI's "left out" for every key but ``messages``.
"""

from __future__ import annotations

import json
import math
import re

from hybridrl_http.server import HttpError

from hybridrl.sampling import NEUTRAL_SAMPLING

ANSWERED = (
    "model",
    "messages",
    "max_completion_tokens",
    "max_tokens",
    "n",
    "stream",
    "logprobs",
    "top_logprobs",
    "store",
)
IGNORED = (  # change neither the answer nor what is stored and trained on
    "user",
    "safety_identifier",
    "metadata",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
)
ROLLOUT_SAMPLING = ("temperature", "top_p", "top_k", "stop")  # the rollout section's keys a request may repeat
OTHER_SAMPLING = {**NEUTRAL_SAMPLING, "logit_bias": {}}  # what the run samples without
TOOLS = "serve answers with text only: it does not parse tool calls from the policy's answers"
TEXT = "serve answers with text only"
REFUSED = {
    "seed": "each answer is seeded by the server (requests that wait are sampled in one call)",
    "tools": TOOLS,
    "tool_choice": TOOLS,
    "parallel_tool_calls": TOOLS,
    "functions": TOOLS,
    "function_call": TOOLS,
    "response_format": f"{TEXT} (only {{'type': 'text'}})",
    "modalities": f"{TEXT} (only ['text'])",
    "audio": TEXT,
    "prediction": "serve has no predicted outputs",
    "web_search_options": "serve does not search the web",
    "reasoning_effort": "the policy has no reasoning effort setting",
    "verbosity": "the policy has no verbosity setting",
    "stream_options": "serve does not stream",
}
ALSO_ACCEPTED = {"response_format": {"type": "text"}, "modalities": ["text"]}  # the values that are what it does


class BadRequest(HttpError):
    """A request the server refuses: ``code`` is its HTTP status, ``param`` the request key at fault
    (OpenAI's ``error.param``), if one is."""

    def __init__(self, code: int, message: str, param: str | None = None):
        super().__init__(code, message)
        self.param = param


def supported() -> str:
    """What the endpoint takes, said in each refusal of an unknown key."""
    return (
        "it takes model, messages, max_completion_tokens (or max_tokens), n=1, stream=false, logprobs, "
        f"top_logprobs=0, store=true, the sampling keys ({', '.join(ROLLOUT_SAMPLING)}, "
        f"{', '.join(OTHER_SAMPLING)}) at the run's values, and ignores {', '.join(IGNORED)}"
    )


UNKNOWN = f"not a key of serve's chat completions ({supported()})"


def sampling_refusal(key: str, value, rollout) -> str | None:
    """Why ``key: value`` is refused (None: it is what the run samples with)."""
    if key in ROLLOUT_SAMPLING:
        allowed, source = getattr(rollout, key), f"rollout.{key}"
        if key == "stop" and isinstance(value, str):
            value = [value]
    else:
        allowed, source = OTHER_SAMPLING[key], key
    if value == allowed and not isinstance(value, bool):
        return None
    return (
        f"'{key}' is {json.dumps(value)[:60]}, but this run samples with {source}={json.dumps(allowed)}: the trainer "
        f"scores what the engine sampled, so the config sets the sampling; remove '{key}' (or send the run's value)"
    )


def refusals(body: dict, rollout) -> list[tuple[str, str]]:
    """``(key, why)`` for each key of ``body`` that the endpoint neither answers nor may ignore."""
    out = []
    for key, value in body.items():
        if key in ANSWERED or key in IGNORED or (value is None and key != "messages"):
            continue
        if key in ROLLOUT_SAMPLING or key in OTHER_SAMPLING:
            why = sampling_refusal(key, value, rollout)
        elif key in REFUSED:
            why = None if ALSO_ACCEPTED.get(key, ...) == value else REFUSED[key]
        else:
            why = UNKNOWN
        if why:
            out.append((key, why))
    return out


def token_limit(body: dict, limit: int) -> int | None:
    """``max_completion_tokens`` (or its deprecated name ``max_tokens``): 1 to ``limit``, or None."""
    given = {k: body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None}
    if len(given) == 2 and given["max_completion_tokens"] != given["max_tokens"]:
        raise BadRequest(
            400,
            f"'max_completion_tokens' ({json.dumps(given['max_completion_tokens'])[:30]}) and 'max_tokens' "
            f"({json.dumps(given['max_tokens'])[:30]}) differ: send one (max_tokens is the deprecated name "
            "of max_completion_tokens)",
            "max_tokens",
        )
    for key, value in given.items():
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= limit:
            raise BadRequest(400, f"'{key}' must be an integer from 1 to {limit} (rollout.max_tokens)", key)
    return next(iter(given.values()), None)


def chat_request(body: dict, rollout) -> dict:
    """The request's ``messages``, ``max_tokens`` (None: rollout.max_tokens) and ``logprobs`` (bool),
    or BadRequest naming the keys it cannot honour."""
    refused = refusals(body, rollout)
    if refused:
        keys: dict[str, list[str]] = {}  # a reason of REFUSED said once for its keys ('tools', 'tool_choice')
        for key, why in refused:
            keys.setdefault(why, []).append(f"'{key[:60]}'")
        shared = {*REFUSED.values(), UNKNOWN}
        message = "; ".join(f"{', '.join(named)}: {why}" if why in shared else why for why, named in keys.items())
        raise BadRequest(400, message, refused[0][0])
    get = body.get
    if get("model") is not None and not isinstance(get("model"), str):
        raise BadRequest(400, "'model' must be a string", "model")
    if get("stream"):
        raise BadRequest(400, "'stream' is not supported: leave it out or set it to false", "stream")
    if get("n") not in (None, 1):
        raise BadRequest(400, "'n' must be 1: each answer is rated on its own", "n")
    if get("store") is False:
        raise BadRequest(400, "serve stores every answer (its ratings train the policy): leave out 'store'", "store")
    if get("logprobs") not in (None, True, False):
        raise BadRequest(400, "'logprobs' must be true or false", "logprobs")
    if get("top_logprobs") not in (None, 0):
        why = "serve keeps the logprob of each sampled token only: leave out 'top_logprobs' or send 0"
        raise BadRequest(400, why, "top_logprobs")
    return {
        "messages": get("messages"),
        "max_tokens": token_limit(body, rollout.max_tokens),
        "logprobs": bool(get("logprobs")),
    }


def completion(answer: dict, model: str, tokens: TokenText | None = None) -> dict:
    """A stored answer as an OpenAI chat completion, with the policy version that sampled it;
    ``tokens``: with the logprobs of its tokens (``logprobs: true``)."""
    prompt, generated = len(answer["prompt_ids"]), len(answer["response_ids"])
    logprobs = tokens.logprobs(answer["response_ids"], answer["logprobs"]) if tokens is not None else None
    return {
        "id": answer["id"],
        "object": "chat.completion",
        "created": int(answer["created"]),
        "model": model,
        "policy_version": answer["version"],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": answer["text"], "refusal": None},
                "logprobs": logprobs,
                "finish_reason": answer["finish_reason"],
            }
        ],
        "usage": {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated},
    }


def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character that stands for each byte in the tokens
    of a byte-level BPE tokenizer (GPT-2, Llama 3, Qwen, SmolLM2), and that byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback
LOWEST_LOGPROB = -9999.0  # OpenAI's stand-in for -inf (JSON has no infinity)


class TokenText:
    """Each token's text and UTF-8 bytes, as OpenAI's logprobs give them. The bytes are exact for
    byte-level BPE tokenizers and SentencePiece's byte pieces: a character split over tokens gives
    each its own bytes, and such a token's text is ``bytes:\\xe2\\x80`` (OpenAI's form). Other tokens
    are the tokenizer's text of the token alone."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = json.loads(backend.to_str()).get("decoder") if backend is not None else None
        self.alphabet = byte_alphabet() if '"ByteLevel"' in json.dumps(decoder) else None
        self.added = set(getattr(tokenizer, "added_tokens_decoder", {}))  # special tokens: their text

    def bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if token_id in self.added:
            return piece.encode()
        if self.alphabet is not None and all(c in self.alphabet for c in piece):
            return bytes(self.alphabet[c] for c in piece)
        if found := BYTE_PIECE.fullmatch(piece):
            return bytes([int(found.group(1), 16)])
        if "\u2581" in piece:  # SentencePiece's space
            return piece.replace("\u2581", " ").encode()
        return self.tokenizer.decode([token_id]).encode()

    def logprobs(self, ids: list[int], logprobs: list[float]) -> dict:
        """OpenAI's ``choices[0].logprobs``: each sampled token with its logprob and bytes."""
        content = []
        for token_id, logprob in zip(ids, logprobs):
            raw = self.bytes(token_id)
            try:
                text = raw.decode()
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            logprob = logprob if math.isfinite(logprob) else LOWEST_LOGPROB
            content.append({"token": text, "logprob": logprob, "bytes": list(raw), "top_logprobs": []})
        return {"content": content, "refusal": None}
