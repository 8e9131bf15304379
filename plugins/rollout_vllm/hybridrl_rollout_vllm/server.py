"""Server mode: generation by a running vLLM OpenAI-compatible server (``rollout.base_url``).

Requests go to ``/v1/completions`` with token-id prompts, one request per prompt (so each gets
its own seed) sent concurrently so the server batches them. Weights reach the server through
the file system: the engine writes the policy as safetensors into a directory the server can
read and asks it to reload them in place (vLLM's ``/collective_rpc`` dev endpoint, method
``reload_weights``), or, with ``server_weights: frozen``, never (the run is then off-policy).
"""

from __future__ import annotations

import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hybridrl.components import RolloutOutput, SamplingParams
from hybridrl.http import ServiceError, get_json, post_json
from hybridrl_rollout_vllm.weights import write_hf_folder

NAME = "rollout engine 'vllm' (server mode)"


class ServerEngine:
    def __init__(self, options, ctx):
        self.options, self.ctx = options, ctx
        base = options.base_url.rstrip("/")
        self.base = base[: -len("/v1")] if base.endswith("/v1") else base
        self.http = dict(component=NAME, timeout=options.timeout, retries=options.retries, token=options.api_key)
        models = [m["id"] for m in (get_json(f"{self.base}/v1/models", **self.http) or {}).get("data", [])]
        if not models:
            raise ServiceError(f"{NAME}: {self.base}/v1/models lists no model. Is it a vLLM server?")
        if options.served_model is not None and options.served_model not in models:
            raise ValueError(
                f"{NAME}: rollout.served_model is '{options.served_model}', but {self.base} serves "
                f"{', '.join(models)}. Set rollout.served_model to one of them."
            )
        self.model = options.served_model or models[0]
        self.weights_dir = Path(options.server_weights_dir or Path(ctx.run_dir) / "vllm_server_weights")
        self.updates = 0
        self.stats: dict[str, float] = {}

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutOutput:
        s = sampling
        base = {
            "model": self.model,
            "n": s.n,
            "max_tokens": s.max_tokens,
            # explicit values everywhere: vLLM fills unset ones from the model's generation_config
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "stop": list(s.stop),
            "ignore_eos": getattr(s, "ignore_eos", False),
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        if not self.options.seed_requests or (s.seeds is None and s.seed is None):
            seeds = [None] * len(prompts)
        else:
            seeds = s.seeds or [s.seed + i * s.n for i in range(len(prompts))]
        payloads = [
            base | {"prompt": list(p)} | ({} if seed is None else {"seed": seed}) for p, seed in zip(prompts, seeds)
        ]
        url = f"{self.base}/v1/completions"
        with ThreadPoolExecutor(max_workers=min(64, len(payloads))) as pool:
            answers = list(pool.map(lambda body: post_json(url, body, **self.http), payloads))
        out = RolloutOutput([], [], [])
        for answer in answers:
            choices = sorted(answer["choices"], key=lambda c: c["index"])
            if len(choices) != s.n:
                raise ServiceError(f"{NAME}: {url} returned {len(choices)} choices for a prompt, expected n={s.n}.")
            for c in choices:
                ids, logprobs = parse_choice(c, url)
                out.token_ids.append(ids)
                out.logprobs.append(logprobs)
                out.finish_reasons.append(c["finish_reason"])
        return out

    def update_weights(self, named_tensors) -> None:
        o = self.options
        self.updates += 1
        if o.server_weights == "frozen":
            if self.updates == 1:
                warnings.warn(
                    f"{NAME}: server_weights is 'frozen', so the server keeps its weights and every rollout from "
                    "now on comes from the initial policy: the run is off-policy, increasingly so "
                    "(see rollout/logprob_diff_*). Set rollout.server_weights: reload to send weights.",
                    stacklevel=2,
                )
            return
        if self.ctx.rank != 0:  # one writer; other ranks still take part in gathering the tensors
            for _ in named_tensors:
                pass
            return
        if self.updates % o.sync_every:
            return
        start = time.perf_counter()
        path = write_hf_folder(named_tensors, self.ctx.model_path, self.weights_dir, o.update_bucket_mb * 2**20)
        self.stats["vllm/server_write_s"] = time.perf_counter() - start
        start = time.perf_counter()
        try:
            post_json(
                f"{self.base}/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": str(path.resolve())}},
                **self.http,
            )
        except ServiceError as e:
            if "HTTP 404" in str(e):
                raise ServiceError(
                    f"{NAME}: {self.base} has no /collective_rpc endpoint, so it cannot reload weights. Start the "
                    "server with VLLM_SERVER_DEV_MODE=1 (and access to rollout.server_weights_dir), or set "
                    "rollout.server_weights: frozen to train off-policy against fixed server weights."
                ) from None
            raise
        post_json(f"{self.base}/reset_prefix_cache", None, **self.http)
        self.stats["vllm/server_reload_s"] = time.perf_counter() - start

    def holds_latest_weights(self) -> bool:
        """Frozen weights, or an update that sync_every skipped, leave the server on older ones."""
        o = self.options
        return o.server_weights != "frozen" and self.updates % o.sync_every == 0

    def sleep(self) -> None:
        """The server's memory is not this process's to hand over."""

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        pass


def parse_choice(choice: dict, url: str) -> tuple[list[int], list[float]]:
    """Token ids and their logprobs from one completion choice; the end-of-sequence token included."""
    lp = choice.get("logprobs") or {}
    logprobs = lp.get("token_logprobs")
    ids = choice.get("token_ids")
    if ids is None and lp.get("tokens") is not None:  # servers without return_token_ids
        ids = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
    if ids is None or logprobs is None:
        raise ServiceError(
            f"{NAME}: {url} answered without token ids or logprobs. It must be a vLLM server "
            "(return_token_ids, logprobs), version 0.10.2 or newer."
        )
    if len(ids) != len(logprobs):
        raise ServiceError(f"{NAME}: {url} returned {len(ids)} tokens but {len(logprobs)} logprobs.")
    if choice.get("finish_reason") not in ("stop", "length"):
        raise ServiceError(f"{NAME}: {url} ended a response with finish reason {choice.get('finish_reason')!r}.")
    return list(ids), [float(x) for x in logprobs]
