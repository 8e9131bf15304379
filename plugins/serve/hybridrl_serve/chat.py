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

from hybridrl_http.openai import (
    IGNORED,
    OTHER_SAMPLING,
    ROLLOUT_SAMPLING,
    BadRequest,
    TokenText,
    sampling_refusal,
    token_limit,
)

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


def supported() -> str:
    """What the endpoint takes, said in each refusal of an unknown key."""
    return (
        "it takes model, messages, max_completion_tokens (or max_tokens), n=1, stream=false, logprobs, "
        f"top_logprobs=0, store=true, the sampling keys ({', '.join(ROLLOUT_SAMPLING)}, "
        f"{', '.join(OTHER_SAMPLING)}) at the run's values, and ignores {', '.join(IGNORED)}"
    )


UNKNOWN = f"not a key of serve's chat completions ({supported()})"


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
