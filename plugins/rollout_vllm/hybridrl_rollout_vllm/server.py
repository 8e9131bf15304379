"""Server mode: generation by a running vLLM OpenAI-compatible server (``rollout.base_url``).

Requests go to ``/v1/completions`` with token-id prompts, one request per prompt (so each gets
its own seed) sent concurrently so the server batches them; where syncs land while requests run
(``in_flight``), to vLLM's token endpoint instead (:mod:`hybridrl_rollout_vllm.in_flight`).
Weights reach the server through the file system: the engine writes the policy as safetensors
into a directory the server can read and asks it to reload them in place (vLLM's
``/collective_rpc`` dev endpoint, method ``reload_weights``), or, with ``server_weights: frozen``,
never (the run is then off-policy). With ``model.lora``, a server that loads adapters at runtime
gets the adapter alone instead, as a new
adapter each sync (``/v1/load_lora_adapter``), which requests name as their ``model``.

The client follows no redirect (the api_key would go along), and checks every answer: n choices
per prompt, token ids inside the policy's vocabulary, finite logprobs of at most 0 (a positive one
is a logit), one per token, at most max_tokens of them. A bad answer is a ServiceError naming the
server, the field and the value.
"""

from __future__ import annotations

import math
import shutil
import sys
import threading
import time
import uuid
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hybridrl_http.client import ServiceError, get_json, post_json

from hybridrl import distributed
from hybridrl.components import NEUTRAL_SAMPLING, RolloutOutput, SamplingParams
from hybridrl_rollout_vllm import in_flight
from hybridrl_rollout_vllm.weights import drop_tied_head, write_hf_folder

NAME = "rollout engine 'vllm' (server mode)"
KEPT_ADAPTERS = 2  # the latest, and the one before for what a rank may still ask of it; and any in use
LOGPROB_SLACK = 1e-4  # a log-probability is at most 0; float rounding may put one a hair above


class ServerEngine:
    def __init__(self, options, ctx):
        self.options, self.ctx = options, ctx
        base = options.base_url.rstrip("/")
        self.base = base[: -len("/v1")] if base.endswith("/v1") else base
        token = options.api_key.get_secret_value() if options.api_key else None
        self.http = dict(component=NAME, timeout=options.timeout, retries=options.retries, token=token)
        listed = get_json(f"{self.base}/v1/models", **self.http)
        data = listed.get("data") if isinstance(listed, dict) else None
        models = [m["id"] for m in data or [] if isinstance(m, dict) and isinstance(m.get("id"), str)]
        if not models:
            raise ServiceError(f"{NAME}: {self.base}/v1/models lists no model. Is it a vLLM server?")
        if options.served_model is not None and options.served_model not in models:
            raise ValueError(
                f"{NAME}: rollout.served_model is '{options.served_model}', but {self.base} serves "
                f"{', '.join(models)}. Set rollout.served_model to one of them."
            )
        self.model = options.served_model or models[0]
        card = next(m for m in data if isinstance(m, dict) and m.get("id") == self.model)
        length = card.get("max_model_len")  # vLLM's model card has it
        self.context = length if isinstance(length, int) and not isinstance(length, bool) and length > 0 else None
        self.vocab = vocab_size(ctx)
        self.weights_dir = Path(options.server_weights_dir or Path(ctx.run_dir) / "vllm_server_weights")
        self.updates = 0
        self.stats: dict[str, float] = {}
        # the trainer sends a tied output layer once, as the checkpoint holds it; vLLM's Llama keeps
        # lm_head a module of its own, whose CPU GEMM copy a reload refreshes only when lm_head.weight
        # comes along, while Gemma-2 has none and refuses it (then it is left out from there on)
        self.tied_head = tied_embeddings(ctx.model_path)
        self.adapters: list[str] = []  # the adapter versions loaded, oldest first; requests ask for the last
        self.labels: dict[str, int] = {}  # each adapter's sync count: its answers' token_versions
        self.names: dict[str, str] = {}  # each one's adapter name ("policy"; a tenant's): a request asks for its newest
        self.in_use: Counter[str] = Counter()  # generate calls running on each adapter: not unloaded
        self.adapter_lock = threading.Lock()
        self.suffix: str | None = None  # this run's adapter names' own ending (a server outlives runs)
        self.in_flight = self._check_in_flight()

    def _check_in_flight(self) -> bool:
        """Whether syncs land while requests run (``in_flight``); 'auto' says once why not, 'on' fails."""
        o = self.options
        if o.in_flight == "off" or o.server_weights == "frozen":
            return False
        why = in_flight.unavailable(self.base, self.http)
        if why and o.in_flight == "on":
            raise ServiceError(f"{NAME}: rollout.in_flight is 'on', but {why}; or set rollout.in_flight: auto.")
        if why and self.ctx.rank == 0:
            print(f"note: {NAME}: weight syncs wait for the requests in flight: {why}.", file=sys.stderr, flush=True)
        return not why

    def updates_in_flight(self) -> bool:
        """Full weights: where the server pauses and labels (``in_flight``). Adapters: a new one loads
        beside those that requests in flight use, which are unloaded only once nothing uses them."""
        if self.adapters:
            return self.options.in_flight != "off"
        return self.in_flight

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutOutput:
        if not self.adapters:
            return self._generate(prompts, sampling, [self.model] * len(prompts))
        with self.adapter_lock:  # the version each request is served by: the newest of its adapter's name
            wanted = sampling.adapters or [None] * len(prompts)
            models = [next(a for a in reversed(self.adapters) if w in (None, self.names[a])) for w in wanted]
            labels = [self.labels[m] for m in models]
            self.in_use.update(set(models))
        try:
            out = self._generate(prompts, sampling, models)
        finally:
            with self.adapter_lock:
                self.in_use.subtract(set(models))
            self._unload_unused()
        out.token_versions = [[labels[i // sampling.n]] * len(ids) for i, ids in enumerate(out.token_ids)]
        return out

    def adapters_per_call(self) -> int:
        """Requests of any adapters go together (the server batches up to its --max-loras adapters; more wait)."""
        return 64 if self.adapters else 1

    def _generate(self, prompts: list[list[int]], sampling: SamplingParams, models: list[str]) -> RolloutOutput:
        s = sampling
        base = {
            "n": s.n,
            "max_tokens": s.max_tokens,
            # explicit values everywhere: vLLM fills unset ones from the model's generation_config
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            **NEUTRAL_SAMPLING,
            "stop": list(s.stop),
            "ignore_eos": getattr(s, "ignore_eos", False),
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        seeds = (s.prompt_seeds(len(prompts)) if self.options.seed_requests else None) or [None] * len(prompts)
        if self.in_flight and not self.adapters:
            return self._generate_tokens(prompts, s, base, seeds)
        payloads = [
            base | {"model": m, "prompt": list(p)} | ({} if seed is None else {"seed": seed})
            for p, seed, m in zip(prompts, seeds, models, strict=True)
        ]
        url = f"{self.base}/v1/completions"
        out = RolloutOutput([], [], [])
        for answer in self._post_all(url, payloads):
            for c in check_choices(answer, s.n, url):
                ids, logprobs = parse_choice(c, url, self.vocab, s.max_tokens)
                out.token_ids.append(ids)
                out.logprobs.append(logprobs)
                out.finish_reasons.append(c["finish_reason"])
        return out

    def _generate_tokens(self, prompts, s: SamplingParams, params: dict, seeds) -> RolloutOutput:
        """Through the token endpoint, whose answers say per token which weights sampled it."""
        url = f"{self.base}{in_flight.GENERATE}"
        payloads = [in_flight.request(p, self.model, params, seed) for p, seed in zip(prompts, seeds)]
        out = RolloutOutput([], [], [], token_versions=[])
        for answer in self._post_all(url, payloads):
            for c in check_choices(answer, s.n, url):
                ids, logprobs, versions = in_flight.parse(c, f"{NAME}: {url} answered choices[{c['index']}]",
                                                          self.vocab, s.max_tokens)  # fmt: skip
                out.token_ids.append(ids)
                out.logprobs.append(logprobs)
                out.finish_reasons.append(c["finish_reason"])
                out.token_versions.append(versions)
        return out

    def _post_all(self, url: str, payloads: list[dict]) -> list:
        """One request per prompt, sent together so that the server batches them."""
        with ThreadPoolExecutor(max_workers=min(64, len(payloads))) as pool:
            return list(pool.map(lambda body: post_json(url, body, **self.http), payloads))

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
        limit = o.update_bucket_mb * 2**20
        path = write_hf_folder(named_tensors, self.ctx.model_path, self.weights_dir, limit, self.tied_head)
        self.stats["vllm/server_write_s"] = time.perf_counter() - start
        start = time.perf_counter()
        if self.in_flight:  # requests in flight go on, prefilled again under the new weights
            in_flight.update(self.base, self.http, lambda: self._load(path), self.updates)
        else:
            self._load(path)
            post_json(f"{self.base}/reset_prefix_cache", None, **self.http)
        self.stats["vllm/server_reload_s"] = time.perf_counter() - start

    def _load(self, path: Path) -> None:
        try:
            self._reload(path)
        except ServiceError as e:
            if self.tied_head and "lm_head" in str(e):  # a model class without an output layer of its own
                self.tied_head = False
                drop_tied_head(path)
                self._reload(path)
            elif "HTTP 404" in str(e):
                raise ServiceError(
                    f"{NAME}: {self.base} has no /collective_rpc endpoint, so it cannot reload weights. Start the "
                    "server with VLLM_SERVER_DEV_MODE=1 (and access to rollout.server_weights_dir), or set "
                    "rollout.server_weights: frozen to train off-policy against fixed server weights."
                ) from None
            else:
                raise

    def takes_adapter(self, config: dict) -> str | None:
        """Where the server loads adapters at runtime (started with --enable-lora and
        VLLM_ALLOW_RUNTIME_LORA_UPDATING=True): asked with a load of a folder that is not there."""
        if self.options.server_weights == "frozen":
            return "rollout.server_weights: frozen"
        probe = {"lora_name": "hybridrl-probe", "lora_path": str(Path(self.weights_dir) / "no-such-adapter")}
        try:
            post_json(f"{self.base}/v1/load_lora_adapter", probe, **self.http | {"retries": 0, "text": True})
        except ServiceError as e:
            said = str(e)
            if '"detail":"NotFound"' in said.replace(" ", ""):  # the web framework's answer: no such route
                return f"{self.base} loads no adapters at runtime (start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)"
            if "--enable-lora" in said:  # vLLM's 'LoRA is not enabled. Use --enable-lora to enable LoRA.'
                return f"{self.base} runs without LoRA (start it with --enable-lora and --max-lora-rank)"
            return None  # the folder is not there: the server would load one that is
        post_json(f"{self.base}/v1/unload_lora_adapter", {"lora_name": "hybridrl-probe"}, **self.http, text=True)
        return None

    def update_adapter(self, adapter) -> None:
        """The adapter, written where the server reads it, loaded under a new name (rank 0; every rank
        asks for it by that name), while requests in flight go on with the one they started on; the
        versions before the one before are unloaded, their folders removed, once nothing uses them.
        Every sync loads one: ``sync_every`` spaces out full reloads, not these."""
        self.updates += 1
        if self.suffix is None:  # every rank asks for rank 0's names: one suffix for all
            self.suffix = distributed.broadcast_object(uuid.uuid4().hex[:8])
        name = f"{Path(self.ctx.run_dir).name}-v{adapter.version}-{self.updates}-{self.suffix}"[-120:]
        if self.ctx.rank == 0:
            folder = adapter.save(self.weights_dir / "adapters" / name)
            body = {"lora_name": name, "lora_path": str(folder.resolve())}
            post_json(f"{self.base}/v1/load_lora_adapter", body, **self.http, text=True)
        with self.adapter_lock:
            self.adapters.append(name)
            self.labels[name], self.names[name] = self.updates, adapter.name
        self._unload_unused()
        self.stats["vllm/adapter_mib"] = adapter.nbytes() / 2**20
        self.stats["vllm/adapters_loaded"] = len(self.adapters)

    def _unload_unused(self, keep: int = KEPT_ADAPTERS) -> None:
        """Unload the adapters older than the latest ``keep`` of their name that no request in flight uses (and,
        once the run's adapters have names, the unnamed one synced at setup)."""
        with self.adapter_lock:
            names = set(self.names.values())
            old = []
            for own in names:
                mine = [a for a in self.adapters if self.names[a] == own]
                old += mine[: len(mine) - keep] if own != "policy" or names == {"policy"} else mine
            old = [a for a in old if not self.in_use[a]]
            self.adapters = [a for a in self.adapters if a not in old]
        for name in old:
            self.labels.pop(name, None)
            self.names.pop(name, None)
            if self.ctx.rank == 0:
                post_json(f"{self.base}/v1/unload_lora_adapter", {"lora_name": name}, **self.http, text=True)
                shutil.rmtree(self.weights_dir / "adapters" / name, ignore_errors=True)

    def _reload(self, path: Path) -> None:
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(path.resolve())}}
        post_json(f"{self.base}/collective_rpc", body, **self.http)

    def holds_latest_weights(self) -> bool:
        """Frozen weights, or an update that sync_every skipped, leave the server on older ones."""
        o = self.options
        return bool(self.adapters) or (o.server_weights != "frozen" and self.updates % o.sync_every == 0)

    def sleep(self) -> None:
        """The server's memory is not this process's to hand over."""

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        """Unload this run's adapters from the server (those a request still running uses stay)."""
        try:
            self._unload_unused(keep=0)
        except ServiceError as e:  # the server may be gone first: nothing of the run depends on it now
            print(f"note: {NAME}: could not unload the run's adapters: {e}", file=sys.stderr, flush=True)


def vocab_size(ctx) -> int | None:
    """How many token ids the policy knows: its config's vocab_size (the embedding's rows), and at least
    its tokenizer's length; None when neither is known."""
    from transformers import AutoConfig

    sizes = [len(ctx.tokenizer)] if ctx.tokenizer is not None else []
    try:
        config = AutoConfig.from_pretrained(ctx.model_path, trust_remote_code=ctx.trust_remote_code)
        sizes.append(int(config.get_text_config().vocab_size))
    except (OSError, ValueError, TypeError, AttributeError):  # no config there: the tokenizer's length
        pass
    return max(sizes) if sizes else None


def check_choices(answer, n: int, url: str) -> list[dict]:
    """The ``n`` choices of one completion answer, in index order; ServiceError when they are not that."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise ServiceError(f"{NAME}: {url} answered without a list of 'choices': {str(answer)[:200]}")
    indexes = sorted(c.get("index") for c in choices if isinstance(c.get("index"), int))
    if indexes != list(range(n)):
        raise ServiceError(
            f"{NAME}: {url} returned choices with indexes {[c.get('index') for c in choices][:20]} for a prompt, "
            f"expected n={n} (0 to {n - 1})."
        )
    return sorted(choices, key=lambda c: c["index"])


def parse_choice(
    choice: dict, url: str, vocab: int | None = None, max_tokens: int | None = None
) -> tuple[list[int], list[float]]:
    """Token ids and their logprobs from one completion choice; the end-of-sequence token included. Ids
    must lie in ``range(vocab)``, logprobs be finite, and there be at most ``max_tokens`` of them (each
    None: not checked); otherwise a ServiceError names the field and the value."""
    where = f"{NAME}: {url} answered choices[{choice.get('index')}]"
    lp = choice.get("logprobs") or {}
    logprobs = lp.get("token_logprobs") if isinstance(lp, dict) else None
    ids = choice.get("token_ids")
    if ids is None and isinstance(lp, dict) and isinstance(lp.get("tokens"), list):  # without return_token_ids
        try:
            ids = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
        except (AttributeError, IndexError, ValueError):
            raise ServiceError(f"{where}.logprobs.tokens is not 'token_id:N' strings: {lp['tokens'][:5]}") from None
    if ids is None or logprobs is None:
        raise ServiceError(
            f"{NAME}: {url} answered without token ids or logprobs. It must be a vLLM server "
            "(return_token_ids, logprobs), version 0.10.2 or newer."
        )
    if not isinstance(ids, list) or not isinstance(logprobs, list):
        raise ServiceError(f"{where}: token_ids and logprobs.token_logprobs must be lists.")
    check_tokens(ids, logprobs, choice.get("finish_reason"), where, vocab, max_tokens)
    return list(ids), [float(x) for x in logprobs]


def check_tokens(
    ids: list, logprobs: list, finish, where: str, vocab: int | None, max_tokens: int | None, field="token_logprobs"
) -> None:
    """One logprob per token, at most ``max_tokens`` of them, ids in ``range(vocab)``, finite
    log-probabilities (``logprobs.<field>``), and a finish reason of stop or length; else a
    ServiceError naming the value."""
    if len(ids) != len(logprobs):
        raise ServiceError(f"{where}: {len(ids)} tokens but {len(logprobs)} logprobs.")
    if max_tokens is not None and len(ids) > max_tokens:
        raise ServiceError(f"{where}: {len(ids)} tokens, over max_tokens={max_tokens}.")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab is not None and t >= vocab):
            raise ServiceError(
                f"{where}.token_ids[{i}] is {str(t)[:50]}, not a token id of the policy's vocabulary "
                f"(0 to {vocab - 1 if vocab else '?'})."
            )
    for i, x in enumerate(logprobs):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise ServiceError(f"{where}.logprobs.{field}[{i}] is {str(x)[:50]}, not a finite number.")
        if x > LOGPROB_SLACK:
            raise ServiceError(
                f"{where}.logprobs.{field}[{i}] is {x:g}, above 0: not a log-probability (logits, as "
                "--logprobs-mode raw_logits or processed_logits gives). Start the server with --logprobs-mode "
                "processed_logprobs."
            )
    if finish not in ("stop", "length"):
        raise ServiceError(f"{where}: a response ended with finish reason {finish!r}.")


def tied_embeddings(model_path: str) -> bool:
    """Whether the model folder's config ties the output layer to the input embedding."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path).get_text_config()
    return bool(getattr(config, "tie_word_embeddings", False))
