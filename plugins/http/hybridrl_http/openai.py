"""What hybridrl's OpenAI-compatible servers share (``hybridrl serve``, the agent gateway of
hybridrl-agents): request checks that refuse rather than ignore, the run's sampling keys, errors in
OpenAI's shape, and each token's text and bytes for ``logprobs``."""

from __future__ import annotations

import json
import math
import re

from hybridrl.sampling import NEUTRAL_SAMPLING
from hybridrl_http.server import HttpError, JsonHandler

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


class BadRequest(HttpError):
    """A request the server refuses: ``code`` is its HTTP status, ``param`` the request key at fault
    (OpenAI's ``error.param``), if one is."""

    def __init__(self, code: int, message: str, param: str | None = None):
        super().__init__(code, message)
        self.param = param


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


def openai_error(code: int, body: dict, param: str | None = None) -> dict:
    """An error reply (``{"error": message, ...}``) in OpenAI's shape, ``{"error": {"message", "type",
    "param", "code"}, ...}``: OpenAI's clients show ``error.message`` and nothing else of the body."""
    if code < 400 or not isinstance(body.get("error"), str):
        return body
    kind = "server_error" if code >= 500 else "invalid_request_error"
    return body | {"error": {"message": body["error"], "type": kind, "param": param, "code": None}}


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


class OpenAIHandler(JsonHandler):
    """A handler whose errors are OpenAI's shape, ``error.param`` naming the key a route refused:
    wrap each route with :meth:`noting_param`."""

    param = None

    def noting_param(self, route):
        def run(*body):
            try:
                return route(*body)
            except BadRequest as e:
                self.param = e.param
                raise

        return run

    def send_json(self, code, body, headers=None):
        param, self.param = self.param, None
        super().send_json(code, openai_error(code, body, param), headers)
