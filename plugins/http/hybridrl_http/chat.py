"""OpenAI's chat completions and (legacy) completions as every hybridrl server answers them
(``hybridrl serve``, the agent gateway of hybridrl-agents): one implementation of the requests'
keys and of the replies, so that the two answer alike and nothing is silently ignored.

Each key of a request is one of:

- **answered** as OpenAI documents it (:data:`CHAT`, :data:`COMPLETIONS`): messages with tool
  calls, ``tools`` and ``tool_choice`` (the calls read from the policy's text by the run's tool
  parser), ``n``, ``stream``, ``stop`` (cut after sampling), ``logprobs``, ``max_completion_tokens``;
- **ignored**: who asks, tags, caching hints (:data:`hybridrl_http.openai.IGNORED`): they change
  nothing that is answered, stored or trained on;
- **the run's sampling** (temperature, top_p, top_k, penalties, logit_bias): the trainer scores what
  the engine sampled, so the config sets the sampling and a key passes only at the run's value;
- **refused** with 400 naming the key and why (:data:`REFUSED`), or as not a key either server
  answers: an agent that sends ``response_format: json_schema`` and gets prose would fail far from
  the cause.

``null`` is OpenAI's "left out" for every key but ``messages``.
"""

from __future__ import annotations

import json
import time
import uuid

from hybridrl_http.openai import IGNORED, OTHER_SAMPLING, BadRequest, sampling_refusal, token_limit
from hybridrl_http.server import EventStream

CHAT = ("model", "messages", "max_completion_tokens", "max_tokens", "n", "stream", "stream_options", "logprobs")
CHAT += ("top_logprobs", "stop", "tools", "tool_choice", "parallel_tool_calls", "store")
COMPLETIONS = ("model", "prompt", "max_tokens", "n", "stream", "stream_options", "logprobs", "stop", "echo")
RUN_SAMPLING = ("temperature", "top_p", "top_k")  # the rollout section's keys, at the run's values
ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_N = 16
MAX_STOPS = 4  # OpenAI's limit
TEXT = "the policy answers with text"
REFUSED = {
    "seed": "each answer is seeded by the server (requests that wait are sampled in one engine call)",
    "functions": "the deprecated form of 'tools': send 'tools' and 'tool_choice'",
    "function_call": "the deprecated form of 'tool_choice': send 'tools' and 'tool_choice'",
    "response_format": f"{TEXT}, never constrained (only {{'type': 'text'}})",
    "modalities": f"{TEXT} (only ['text'])",
    "audio": TEXT,
    "prediction": "there are no predicted outputs",
    "web_search_options": "the server does not search the web",
    "reasoning_effort": "the policy has no reasoning effort setting",
    "verbosity": "the policy has no verbosity setting",
}
ALSO_ACCEPTED = {"response_format": {"type": "text"}, "modalities": ["text"]}  # the values that are what it does


def unknown(keys: tuple[str, ...]) -> str:
    return (
        f"not a key hybridrl answers (it takes {', '.join(keys)}, the sampling keys "
        f"({', '.join(RUN_SAMPLING)}, {', '.join(OTHER_SAMPLING)}) at the run's values, and ignores "
        f"{', '.join(IGNORED)})"
    )


def refuse_unknown(body: dict, keys: tuple[str, ...], rollout) -> None:
    """400 naming every key of ``body`` that is neither answered nor ignorable, each with why once."""
    refused: dict[str, list[str]] = {}
    for key, value in body.items():
        if key in keys or key in IGNORED or value is None:
            continue
        if key in RUN_SAMPLING or key in OTHER_SAMPLING:
            why = sampling_refusal(key, value, rollout)
        elif key in REFUSED:
            why = None if ALSO_ACCEPTED.get(key, ...) == value else REFUSED[key]
        else:
            why = unknown(keys)
        if why:
            refused.setdefault(why, []).append(key)
    if refused:
        shared = {*REFUSED.values(), unknown(keys)}  # said once for all its keys ('functions', 'bar')
        said = [f"{', '.join(repr(k[:60]) for k in ks)}: {w}" if w in shared else w for w, ks in refused.items()]
        message = "; ".join(said)
        raise BadRequest(400, message, next(iter(refused.values()))[0])


def stops(value) -> list[str]:
    """``stop``: a string or up to four strings (cut after the engine samples)."""
    value = [value] if isinstance(value, str) else value
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_STOPS or not all(isinstance(s, str) and s for s in value):
        raise BadRequest(400, f"'stop' must be a string or a list of up to {MAX_STOPS} non-empty strings", "stop")
    return value


def choices(body: dict) -> int:
    n = body.get("n", 1) if body.get("n") is not None else 1
    if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= MAX_N:
        raise BadRequest(400, f"'n' must be an integer from 1 to {MAX_N}", "n")
    return n


def text_content(content, where: str) -> str:
    """A message's content: a string, or OpenAI's list of ``{"type": "text", "text": ...}`` parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        if all(isinstance(p.get("text"), str) for p in content):
            return "".join(p["text"] for p in content)
    raise BadRequest(400, f"{where}: content must be a string or a list of text parts (the policy reads text)", where)


def messages(value) -> list[dict]:
    """The chat's messages, checked: roles, text content, tool calls of assistant messages."""
    if not isinstance(value, list) or not value:
        raise BadRequest(400, "'messages' must be a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(400, f"{where} needs a role: {', '.join(sorted(ROLES))}", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        message = {"role": role, "content": text_content(m.get("content"), where)}
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise BadRequest(400, f"{where}: tool_calls belong to assistant messages, as a list", "messages")
            message["tool_calls"] = [tool_call(c, f"{where}.tool_calls") for c in calls]
        for key in ("tool_call_id", "name"):
            if isinstance(m.get(key), str):
                message[key] = m[key]
        out.append(message)
    return out


def tool_call(call, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise BadRequest(400, f"{where}: each call needs function.name and function.arguments", "messages")
    arguments = function.get("arguments")
    if not isinstance(arguments, (str, dict)):
        raise BadRequest(400, f"{where}: function.arguments must be a JSON string", "messages")
    if isinstance(arguments, str):  # OpenAI sends a JSON string; chat templates render an object
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass  # kept as sent: the template shows it as it is
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def tools(body: dict) -> list[dict] | None:
    """The tools' schemas for the chat template (None: no tools, or ``tool_choice: none``)."""
    value, choice = body.get("tools"), body.get("tool_choice")
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(
        isinstance(t, dict) and t.get("type") == "function" and isinstance((t.get("function") or {}).get("name"), str)
        for t in value
    ):
        raise BadRequest(400, "'tools' must be a list of {type: function, function: {name, ...}}", "tools")
    named = isinstance(choice, dict) and isinstance((choice.get("function") or {}).get("name"), str)
    if choice not in (None, "auto", "none", "required") and not named:
        why = "'tool_choice' must be auto, none, required or {type: function, function: {name}}"
        raise BadRequest(400, why, "tool_choice")
    return None if choice == "none" else value


def forced(body: dict) -> bool:
    """``tool_choice`` asks for a call (required, or a named function). Sampling is never
    constrained, which would train on tokens the policy did not choose: the request is answered as
    the policy samples it, and a reply without a call is counted."""
    choice = body.get("tool_choice")
    return bool(body.get("tools")) and (choice == "required" or isinstance(choice, dict))


def chat(body, rollout) -> dict:
    """A chat completion request, checked: messages, tools, n, stop, stream, logprobs, max_tokens."""
    if not isinstance(body, dict):
        raise BadRequest(400, "the body must be a JSON object")
    refuse_unknown(body, CHAT, rollout)
    if body.get("top_logprobs") not in (None, 0):
        why = "each sampled token's logprob is kept, no others: leave out 'top_logprobs' or send 0"
        raise BadRequest(400, why, "top_logprobs")
    if body.get("logprobs") not in (None, True, False):
        raise BadRequest(400, "'logprobs' must be true or false", "logprobs")
    if body.get("store") is False:
        why = "every answer is stored (it is what the policy trains on): leave out 'store' or send true"
        raise BadRequest(400, why, "store")
    if body.get("model") is not None and not isinstance(body.get("model"), str):
        raise BadRequest(400, "'model' must be a string", "model")
    chat = {"messages": messages(body.get("messages")), "tools": tools(body), "forced": forced(body)}
    return chat | answering(body, rollout)


def completions(body, rollout) -> dict:
    """A (legacy) completion request: a prompt string or token ids, n, stop, logprobs (0 or 1)."""
    if not isinstance(body, dict):
        raise BadRequest(400, "the body must be a JSON object")
    refuse_unknown(body, COMPLETIONS, rollout)
    prompt = body.get("prompt")
    ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not ids:
        raise BadRequest(400, "'prompt' must be one non-empty string or one list of token ids", "prompt")
    if body.get("echo"):
        raise BadRequest(400, "'echo' is not supported: the reply holds the completion alone", "echo")
    if body.get("logprobs") not in (None, 0, 1):
        raise BadRequest(400, "'logprobs' must be 0 or 1: the sampled tokens' logprobs are given", "logprobs")
    return {"prompt": prompt} | answering(body, rollout)


def answering(body: dict, rollout) -> dict:
    """What both endpoints take alike: n, stop, stream (with usage), logprobs, max_tokens."""
    return {
        "n": choices(body),
        "stop": stops(body.get("stop")),
        "stream": bool(body.get("stream")),
        "usage_in_stream": bool((body.get("stream_options") or {}).get("include_usage")),
        "logprobs": bool(body.get("logprobs")),
        "max_tokens": token_limit(body, rollout.max_tokens) or rollout.max_tokens,
    }


def dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


# -- replies ---------------------------------------------------------------------------------


def cut_at_stop(answer: dict, stop: list[str], decode) -> tuple[dict, str]:
    """The answer up to the first token whose text completes a stop string, and its text before
    that string (OpenAI's ``stop``: the stop string is not returned)."""
    text = decode(answer["ids"])
    if not stop or not any(s in text for s in stop):
        return answer, text
    for k in range(1, len(answer["ids"]) + 1):
        text = decode(answer["ids"][:k])
        hits = [text.index(s) for s in stop if s in text]
        if hits:
            cut = answer | {"ids": answer["ids"][:k], "logprobs": answer["logprobs"][:k], "finish_reason": "stop"}
            return cut, text[: min(hits)]
    return answer, text


def assistant_message(text: str, tools, finish: str, parser) -> tuple[dict, str, int]:
    """The reply's assistant message for the policy's ``text``, its finish reason, and how many
    calls were malformed: with ``tools``, the calls ``parser`` reads are OpenAI's ``tool_calls``
    (their text out of ``content``); a malformed call stays text."""
    calls = parser.parse(text) if tools else []
    good = [c for c in calls if c.error is None]
    if not good:
        return {"role": "assistant", "content": text, "refusal": None}, finish, len(calls)
    tool_calls = [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
         "function": {"name": c.name, "arguments": dumps(c.arguments)}}
        for c in good
    ]  # fmt: skip
    message = {"role": "assistant", "content": parser.content(text) or None, "refusal": None, "tool_calls": tool_calls}
    return message, "tool_calls" if finish == "stop" else finish, len(calls) - len(good)


def reply(kind: str, model: str, choices: list[dict], prompt_tokens: int, generated: int, **extra) -> dict:
    """A chat completion (``kind`` chat.completion) or completion (text_completion) reply; ``extra``:
    what hybridrl adds (``policy_version``, ``episode_id``) and ``id``, ``created`` when given."""
    head = {
        "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
    }
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": generated, "total_tokens": prompt_tokens + generated}
    return head | extra | {"choices": choices, "usage": usage}


def stream(reply: dict, usage: bool) -> EventStream:
    """A reply as OpenAI's stream of chunks: per choice, the role, the content, the tool calls,
    then the finish reason; the usage last when ``stream_options.include_usage``."""
    chat = reply["object"] == "chat.completion"
    head = {k: v for k, v in reply.items() if k not in ("object", "choices", "usage")}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    events = []
    for c in reply["choices"]:
        if chat:
            m = c["message"]
            delta = {"role": "assistant", "content": m["content"] or ""}
            if m.get("tool_calls"):
                delta["tool_calls"] = [{"index": k} | call for k, call in enumerate(m["tool_calls"])]
            part = {"index": c["index"], "delta": delta, "logprobs": c["logprobs"], "finish_reason": None}
            end = {"index": c["index"], "delta": {}, "logprobs": None, "finish_reason": c["finish_reason"]}
        else:
            part = c | {"finish_reason": None}
            end = {"index": c["index"], "text": "", "logprobs": None, "finish_reason": c["finish_reason"]}
        events += [head | {"choices": [part]}, head | {"choices": [end]}]
    if usage:
        events.append(head | {"choices": [], "usage": reply["usage"]})
    return EventStream(events)
