"""The gateway's OpenAI request keys: which it answers, which it ignores, which it refuses and why.

Like ``hybridrl serve`` (:mod:`hybridrl_http.openai`), nothing is silently ignored: a key either
changes the answer as OpenAI documents, changes nothing that is trained on (who asks, caching
hints), is a sampling key at the run's value (the trainer scores what the engine sampled, so the
config sets the sampling), or is refused with 400 naming it.
"""

from __future__ import annotations

import json

from hybridrl_http.openai import IGNORED, OTHER_SAMPLING, BadRequest, sampling_refusal, token_limit

CHAT = ("model", "messages", "max_completion_tokens", "max_tokens", "n", "stream", "stream_options", "logprobs")
CHAT += ("top_logprobs", "stop", "tools", "tool_choice", "parallel_tool_calls", "store")
COMPLETIONS = ("model", "prompt", "max_tokens", "n", "stream", "stream_options", "logprobs", "stop", "echo")
RUN_SAMPLING = ("temperature", "top_p", "top_k")  # the rollout section's keys, at the run's values
ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_N = 16
MAX_STOPS = 4  # OpenAI's limit


def unknown(keys: tuple[str, ...]) -> str:
    return (
        f"not a key the gateway answers (it takes {', '.join(keys)}, the sampling keys "
        f"({', '.join(RUN_SAMPLING)}, {', '.join(OTHER_SAMPLING)}) at the run's values, and ignores "
        f"{', '.join(IGNORED)})"
    )


def refuse_unknown(body: dict, keys: tuple[str, ...], rollout) -> None:
    for key, value in body.items():
        if key in keys or key in IGNORED or value is None:
            continue
        if key in RUN_SAMPLING or key in OTHER_SAMPLING:
            why = sampling_refusal(key, value, rollout)
        else:
            why = f"'{key[:60]}': {unknown(keys)}"
        if why:
            raise BadRequest(400, why, key)


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
    """``tool_choice`` asks for a call (required, or a named function). The gateway never constrains
    sampling, which would train on tokens the policy did not choose: the request is answered as the
    policy samples it, and a reply without a call is counted."""
    choice = body.get("tool_choice")
    return bool(body.get("tools")) and (choice == "required" or isinstance(choice, dict))


def chat(body, rollout) -> dict:
    """A chat completion request, checked: messages, tools, n, stop, stream, logprobs, max_tokens."""
    if not isinstance(body, dict):
        raise BadRequest(400, "the body must be a JSON object")
    refuse_unknown(body, CHAT, rollout)
    if body.get("top_logprobs") not in (None, 0):
        raise BadRequest(
            400, "the gateway gives each sampled token's logprob only: send top_logprobs 0", "top_logprobs"
        )
    if body.get("logprobs") not in (None, True, False):
        raise BadRequest(400, "'logprobs' must be true or false", "logprobs")
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
        raise BadRequest(400, "'logprobs' must be 0 or 1: the gateway gives the sampled tokens' logprobs", "logprobs")
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
