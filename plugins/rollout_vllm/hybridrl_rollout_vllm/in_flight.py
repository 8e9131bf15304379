"""Weight updates in flight against a vLLM server (``in_flight``): a sync lands while requests run.

Requests go to vLLM's token-in, token-out endpoint (``/inference/v1/generate``), whose answers say
per token which weights sampled it (``weight_versions``: spans of output tokens under a version
label). A sync, from the trainer's thread while the prefetch thread's requests are in flight:

1. ``POST /pause?mode=keep``: the scheduler stops between two decoding steps; its requests stay
   queued with their tokens (none aborted, no token thrown away); vLLM 0.32 also drops their KV
   cache here (``clear_cache``, on by default);
2. the weights are reloaded in place (``/collective_rpc``, as any server sync);
3. ``POST /reset_prefix_cache?reset_running_requests=true``: the KV cache of every request, computed
   by the old weights, is dropped and the prefix cache emptied, so each request goes on after
   prefilling its prompt and its tokens so far again under the new weights (the tokens after the
   sync are sampled exactly as the new policy samples them, and a new request's prompt never
   reuses a prefix the old weights computed);
4. ``POST /update_weight_version``: the label of the tokens from now on, the count of the engine's
   syncs;
5. ``POST /resume``, whatever happened before.

The server needs ``VLLM_SERVER_DEV_MODE=1`` (pause, resume, reload, labels) and
``--enable-scale-out`` (the token endpoint).
"""

from __future__ import annotations

from hybridrl_http.client import ServiceError, post_json

GENERATE = "/inference/v1/generate"


def unavailable(base: str, http: dict) -> str | None:
    """Why the server cannot take syncs in flight (one line), or None when it can. Labels its weights
    0 (the run's first), so the labels the answers carry are this run's sync counts."""
    try:
        labelled = post_json(f"{base}/update_weight_version", {"new_version": "0"}, **http | {"retries": 0})
    except ServiceError as e:
        if "HTTP 404" not in str(e):
            raise
        labelled = None
    if not (isinstance(labelled, dict) and labelled.get("success")):
        return f"{base} does not label its weights (/update_weight_version: start it with VLLM_SERVER_DEV_MODE=1)"
    try:
        answer = post_json(f"{base}{GENERATE}", {"token_ids": [0], "sampling_params": {"max_tokens": 1}}, **http)
    except ServiceError as e:
        if "HTTP 403" in str(e):
            return f"{base} serves no {GENERATE} (start it with --enable-scale-out)"
        if "HTTP 404" in str(e):
            return f"{base} has no {GENERATE} (vLLM 0.32 or newer has it)"
        raise
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not (isinstance(choices, list) and choices and isinstance(choices[0], dict) and "weight_versions" in choices[0]):
        return f"{base}{GENERATE} does not say which weights sampled a token (vLLM 0.32 or newer does)"
    return None


def request(prompt: list[int], model: str, params: dict, seed: int | None) -> dict:
    """The body of one prompt's request: ``params`` are the sampling keys of /v1/completions."""
    sampling = {k: v for k, v in params.items() if k not in ("model", "return_token_ids", "return_tokens_as_token_ids")}
    sampling |= {} if seed is None else {"seed": seed}
    return {"token_ids": list(prompt), "model": model, "sampling_params": sampling}


def parse(choice: dict, where: str, vocab: int | None, max_tokens: int) -> tuple[list[int], list[float], list[int]]:
    """Token ids, their logprobs and, per token, the engine's sync count that sampled it, from one
    choice of the token endpoint; a ServiceError names the field and the value that is wrong."""
    from hybridrl_rollout_vllm.server import check_tokens

    ids = choice.get("token_ids")
    content = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
    if not isinstance(ids, list) or not isinstance(content, list) or not all(isinstance(c, dict) for c in content):
        raise ServiceError(f"{where} without token_ids and logprobs.content lists: {str(choice)[:200]}")
    logprobs = [c.get("logprob") for c in content]
    check_tokens(ids, logprobs, choice.get("finish_reason"), where, vocab, max_tokens, "content[].logprob")
    return list(ids), [float(x) for x in logprobs], versions(choice.get("weight_versions"), len(ids), where)


def versions(spans, tokens: int, where: str) -> list[int]:
    """Per token, the sync count of the span that holds it. The spans must cover the tokens, in order,
    and name counts; else nothing of the answer can be trained on."""
    out: list[int] = []
    if tokens == 0:
        return out
    for span in spans if isinstance(spans, list) else [None]:
        try:
            label, start, end = int(span["version"]), int(span["start"]), int(span["end"])
        except (TypeError, KeyError, ValueError):
            raise ServiceError(
                f"{where}: weight_versions {str(spans)[:200]} do not name this run's weights (labels 0, 1, ...: "
                "another client relabelled the server?); its tokens are not trained on."
            ) from None
        if start != len(out) or end < start or label < 0:
            raise ServiceError(f"{where}: weight_versions {str(spans)[:200]} do not cover the tokens in order.")
        out += [label] * (end - start)
    if len(out) != tokens or any(b < a for a, b in zip(out, out[1:])):
        raise ServiceError(f"{where}: weight_versions {str(spans)[:200]} do not fit its {tokens} tokens in order.")
    return out


def update(base: str, http: dict, reload, label: int) -> None:
    """Steps 1 to 5 of the module's docstring around ``reload()``."""
    post_json(f"{base}/pause?mode=keep", None, **http)
    try:
        reload()
        reset = post_json(f"{base}/reset_prefix_cache?reset_running_requests=true", None, **http)
        if not (isinstance(reset, dict) and reset.get("success")):
            raise ServiceError(f"{base} could not drop the KV cache of its requests in flight: {str(reset)[:200]}")
        post_json(f"{base}/update_weight_version", {"new_version": str(label)}, **http)
    finally:
        post_json(f"{base}/resume", None, **http)
