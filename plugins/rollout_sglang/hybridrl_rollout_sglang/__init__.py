"""Rollout engine ``sglang``: SGLang in this process (``sglang.Engine``) or a running SGLang server.

``rollout.engine: sglang`` starts ``sglang.Engine`` on this process's GPU; with
``rollout.base_url`` it talks to a server through SGLang's native API instead. Either way it
returns token ids with the logprob of each sampled token, takes the trainer's weights in
place after every step, and frees its GPU memory while the policy trains.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import uuid
from collections import Counter
from typing import Any, Literal

from pydantic import Field, field_validator

from hybridrl.components import Options, RolloutEngine, RolloutOutput, SamplingParams
from hybridrl.engines import weight_buckets
from hybridrl.hookspecs import hookimpl
from hybridrl.options import Secret
from hybridrl_rollout_sglang import backends, protocol
from hybridrl_rollout_sglang.backends import InProcess, original_logprob_env
from hybridrl_rollout_sglang.server import Server

__version__ = "0.1.0"

IN_PROCESS_ONLY = (
    "mem_fraction_static",
    "tp_size",
    "context_length",
    "attention_backend",
    "dtype",
    "enable_memory_saver",
    "skip_tokenizer_init",
    "log_level",
    "engine_kwargs",
)
SERVER_ONLY = (
    "api_key",
    "timeout",
    "retries",
    "concurrency",
    "weights_dir",
    "server_weights_dir",
    "release_memory_on_sleep",
    "in_flight",
)


class SGLangEngine(RolloutEngine):
    class Options(Options):
        # -- mode
        base_url: str | None = Field(
            None,
            description="URL of a running SGLang server (http://host:30000); unset: start sglang.Engine "
            "in this process, on the policy's GPU.",
        )
        # -- both modes
        batch_size: int = Field(
            0, ge=0, description="Requests (prompt x sample) per generate call; 0: all of a step's in one call."
        )
        update_bucket_mb: float = Field(
            512,
            gt=0,
            description="Weight sync sends tensors in buckets of about this many MiB (in-process: one "
            "update_weights_from_tensor call each; server: one safetensors shard each).",
        )
        per_request_seed: bool = Field(
            False,
            description="Give each request SGLang's sampling_seed (the step's seed + row). SGLang honours it "
            "with enable_deterministic_inference (set it in engine_kwargs or on the server).",
        )
        stop_in_engine: bool = Field(
            False,
            description="Send rollout.stop to SGLang, which stops at them (needs SGLang's tokenizer: "
            "skip_tokenizer_init false, or a server started without --skip-tokenizer-init). Otherwise "
            "responses run to EOS or max_tokens and are cut after the stop string here: same responses, "
            "more tokens generated.",
        )
        release_weights: bool = Field(
            True,
            description="While the policy trains, free the engine's weights too (they come back with the "
            "trainer's update); false: free only the KV cache and CUDA graphs.",
        )
        weights_cpu_backup: bool = Field(
            False,
            description="SGLang keeps a CPU copy of released weights (enable_weights_cpu_backup; in server "
            "mode: the server was started with --enable-weights-cpu-backup). Needed with release_weights "
            "when the trainer may skip a step's weight sync (a step with nothing to train).",
        )
        # -- in-process engine
        mem_fraction_static: float = Field(
            0.5, gt=0, lt=1, description="Fraction of GPU memory SGLang takes for weights and KV cache."
        )
        tp_size: int = Field(1, ge=1, description="Tensor-parallel GPUs of the engine.")
        context_length: int | None = Field(
            None, gt=0, description="Longest prompt + response; default: the model config's."
        )
        attention_backend: str | None = Field(
            None, description="SGLang attention backend (fa3, flashinfer, triton...); default: SGLang's choice."
        )
        dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
            "auto",
            description="Engine weight dtype; 'auto' is SGLang's rule: the checkpoint's dtype, but float16 for "
            "a float32 checkpoint (bfloat16 for Gemma). float32 is refused: SGLang's CUDA kernels take 16-bit "
            "weights only. The trainer's weights are cast to it at each sync.",
        )
        enable_memory_saver: bool | Literal["auto"] = Field(
            "auto",
            description="Release the weights, KV cache and CUDA graphs while the policy trains "
            "(release/resume_memory_occupation); false: sleep() keeps them, which saves the release, the "
            "resume and the training passes' allocations at every step. 'auto': false where "
            "mem_fraction_static and the policy's training state (float32 weights, gradients and AdamW "
            "moments) leave at least a quarter of the GPU for the passes, else true.",
        )
        skip_tokenizer_init: bool = Field(
            True, description="Run SGLang on token ids only, without loading the tokenizer."
        )
        log_level: str = Field("warning", description="SGLang's log level (debug, info, warning, error).")
        engine_kwargs: dict[str, Any] = Field(
            default_factory=dict,
            description="Extra keyword arguments of sglang.Engine (its server arguments), e.g. "
            "{cuda_graph_max_bs: 256, enable_deterministic_inference: true}.",
        )
        # -- server mode
        api_key: Secret | None = Field(None, description="The server's --api-key, sent as a bearer token.")
        timeout: float = Field(600.0, gt=0, description="Seconds each HTTP call may take before it is retried.")
        retries: int = Field(3, ge=0, description="Retries of a failed call (connection errors, 5xx, 429).")
        concurrency: int = Field(1, ge=1, description="Generate calls in flight at once (with batch_size).")
        weights_dir: str | None = Field(
            None,
            description="Where each weight update is saved as a Hugging Face folder for the server's "
            "update_weights_from_disk; default: <run dir>/sglang_weights. Only the latest is kept.",
        )
        server_weights_dir: str | None = Field(
            None, description="weights_dir as the server sees it, when it mounts the folder at another path."
        )
        release_memory_on_sleep: bool = Field(
            False,
            description="Ask the server to release its GPU memory while the policy trains (a server on the "
            "training GPUs, started with --enable-memory-saver).",
        )
        in_flight: Literal["auto", "on", "off"] = Field(
            "auto",
            description="A sync lands while requests run (rollout.async does not wait for the batches generated "
            "ahead): the server retracts its running requests between two decoding steps (/pause_generation, mode "
            "retract), loads the new weights and goes on (/continue_generation), prefilling each request's prompt "
            "and tokens so far again under them; nothing is aborted. SGLang does not say which weights sampled "
            "each token, so a response counts at the version it started with, its oldest. An adapter sync (model.lora) "
            "needs no pause: the new adapter loads beside those requests in flight use. 'auto': where the server has "
            "those calls (SGLang 0.5) and runs without its radix cache (--disable-radix-cache: the prompts' keys and "
            "values it keeps would outlive the sync) (else full-weight syncs wait, saying why once); 'on': required; "
            "'off': syncs wait.",
        )

        @field_validator(*IN_PROCESS_ONLY, *SERVER_ONLY)
        @classmethod
        def _mode_option(cls, value, info):
            server = bool(info.data.get("base_url"))  # base_url is declared first, so validated first
            if server and info.field_name in IN_PROCESS_ONLY:
                raise ValueError(
                    "applies to the in-process engine only; with base_url the server's launch flags decide it"
                )
            if not server and info.field_name in SERVER_ONLY:
                raise ValueError("applies to server mode only; set base_url to a running SGLang server")
            return value

        @field_validator("dtype")
        @classmethod
        def _sixteen_bits(cls, value):
            if value == "float32":
                raise ValueError(
                    "SGLang's CUDA kernels take 16-bit weights only (SGLang 0.5.17 fails at start: rmsnorm "
                    "'failed to dispatch data type Float'). Use bfloat16 or float16 (auto: float16 for a "
                    "float32 checkpoint), or rollout.engine: vllm or hf for an engine in the policy's float32."
                )
            return value

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.stop_ids, tied = protocol.model_facts(ctx.model_path, ctx.tokenizer)
        self.skip = {"lm_head.weight"} if tied else set()
        if options.stop_in_engine and not options.base_url and options.skip_tokenizer_init:
            raise ValueError(
                f"{protocol.COMPONENT}: stop_in_engine needs SGLang's tokenizer; set skip_tokenizer_init: false."
            )
        self.backend = Server(options, ctx) if options.base_url else InProcess(options, ctx)
        self.version = 0
        self.adapter: str | None = None  # the newest adapter's name (model.lora.sync): new requests ask for it
        self.newest: dict[str, str] = {}  # the newest of each adapter's name (hybridrl tenants: one per tenant)
        self.adapter_loads = 0  # adapter syncs: each response's token_versions
        # a server outlives runs (and holds a killed run's adapters): this engine's names are its own
        self.suffix = f"-{uuid.uuid4().hex[:8]}" if options.base_url else ""
        self.loaded: dict[str, int] = {}  # adapters loaded, oldest first -> the sync that loaded each
        self.in_use: Counter[str] = Counter()  # generate calls running on each adapter: not unloaded
        self.adapter_lock = threading.Lock()

    @classmethod
    def check_launch(cls, options, ctx) -> None:
        """Before any model loads: an in-process engine needs a GPU and SGLang, and under torchrun runs
        one engine per rank (SGLang has no mode in which training processes are an engine's TP workers)."""
        if options.base_url:
            return
        reason = backends.unavailable()
        if reason:
            raise ValueError(reason)
        if ctx.world_size > 1 and options.tp_size > 1:
            raise ValueError(
                f"tp_size={options.tp_size} under torchrun: an in-process SGLang engine cannot span training "
                "ranks (it would start its own tensor-parallel workers on GPUs the other ranks train on). Use "
                "tp_size: 1 (an engine per rank), rollout.engine: vllm with tensor_parallel_size (the ranks are "
                "its workers), or a separate SGLang server (rollout.base_url)."
            )

    def context_length(self) -> int | None:
        """The run's longest sequence (its longest prompt and rollout.max_tokens). SGLang picks LongRoPE's
        factors for each forward batch, long when a position passes the original length: for a run
        that stays within the original length that is the short set in every batch, which the trainer
        then uses; past it, a batch's set depends on its sequences, and the trainer uses the long set."""
        return (self.ctx.prompt_tokens or 0) + (self.ctx.response_tokens or 0) or None

    def memory_options(self, half_prompts: int) -> str:
        return f"rollout.mem_fraction_static (its share of the GPU) or rollout.batch_size (try {half_prompts})"

    def seeds_each_request(self) -> bool:
        return self.options.per_request_seed

    def runs_apart(self) -> bool:
        return bool(self.options.base_url)

    def updates_in_flight(self) -> bool:
        """Full weights: where the server pauses its requests (its ``in_flight``). Adapters, on a server:
        a new one loads beside those that requests in flight use, unloaded once nothing uses them."""
        if self.adapter is not None and self.options.base_url:
            return self.options.in_flight != "off"
        return self.backend.in_flight

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutOutput:
        o = self.options
        if not o.base_url and original_logprob_env() and sampling.temperature != 1.0:
            raise ValueError(
                f"{protocol.COMPONENT}: SGLANG_RETURN_ORIGINAL_LOGPROB is set, so SGLang returns logprobs "
                f"before the temperature, but rollout.temperature is {sampling.temperature}; the trainer "
                "needs temperature-scaled logprobs. Unset the variable."
            )
        request = protocol.generate_request(
            prompts, sampling, self.stop_ids, stop_in_engine=o.stop_in_engine, per_request_seed=o.per_request_seed
        )
        n = sampling.n
        with self._adapters_in_use(sampling.adapters or [None] * len(prompts)) as (names, labels):
            if names[0] is not None:  # each prompt asks for the newest of its adapter's name
                request["lora_path"] = [names[i // n] for i in range(len(request["input_ids"]))]
            items = self.backend.generate_many(protocol.split_request(request, o.batch_size))
        decode = self.ctx.tokenizer.decode if sampling.stop else None
        out = protocol.to_rollout_output(items, len(request["input_ids"]), sampling.stop, decode)
        if names[0] is not None:  # an adapter's weights sampled each of its tokens, whatever synced meanwhile
            out.token_versions = [[labels[i // n]] * len(ids) for i, ids in enumerate(out.token_ids)]
        return out

    @contextlib.contextmanager
    def _adapters_in_use(self, wanted: list[str | None]):
        """For each prompt (``wanted``: its adapter's name, None: the one synced last), the newest adapter of that
        name (None: none yet) and the sync that loaded it, each kept loaded while the call runs."""
        with self.adapter_lock:
            names = [self.newest[w] if w is not None else self.adapter for w in wanted]
            for name in set(names):
                self.in_use[name] += 1
            labels = [self.loaded.get(name) for name in names]
        try:
            yield names, labels
        finally:
            with self.adapter_lock:
                for name in set(names):
                    self.in_use[name] -= 1
            self._unload_unused()

    def update_weights(self, named_tensors) -> None:
        self.version += 1
        bucket_bytes = int(self.options.update_bucket_mb * 2**20)
        buckets = weight_buckets(named_tensors, bucket_bytes, skip=self.skip, drop_aliases=True)
        self.backend.update_weights(buckets, self.version)

    def takes_adapter(self, config: dict) -> str | None:
        return self.backend.adapter_refusal(config)

    def update_adapter(self, adapter) -> None:
        self.adapter_loads += 1  # a new name each sync: SGLang caches an adapter by its name
        name = f"{adapter.name}-v{adapter.version}-{self.adapter_loads}{self.suffix}"
        self.backend.update_adapter(adapter, name)
        with self.adapter_lock:
            self.adapter, self.loaded[name] = name, self.adapter_loads
            self.newest[adapter.name] = name
            if adapter.name != "policy":  # the run's adapters have names (tenants): the one synced at setup goes
                self.newest.pop("policy", None)
        self._unload_unused()

    def adapters_per_call(self) -> int:
        """Adapters of several names mix in a call (SGLang selects each request's): as many as a batch holds."""
        return self.backend.loras_per_batch() if self.adapter is not None else 1

    def _unload_unused(self) -> None:
        """Unload the adapters before the newest of each name that no call in flight uses (in this process:
        all of them)."""
        with self.adapter_lock:
            keep = {self.adapter, *self.newest.values()}
            old = [a for a in self.loaded if a not in keep and not self.in_use[a]]
            for a in old:
                del self.loaded[a]
        for a in old:
            self.backend.unload_adapter(a)

    def sleep(self) -> None:
        self.backend.sleep()

    def wake_up(self) -> None:
        self.backend.wake_up()

    def close(self) -> None:
        """Unload this run's adapters from a server (those requests still running use stay: SGLang evicts
        them), then shut an engine of this process down."""
        if self.options.base_url and self.adapter is not None:
            with self.adapter_lock:
                self.adapter, self.newest = None, {}
            try:
                self._unload_unused()
            except Exception as e:  # noqa: BLE001 - the server may be gone first: nothing depends on it now
                print(f"note: {protocol.COMPONENT}: could not unload the run's adapters: {e}", file=sys.stderr)
        self.backend.shutdown()


@hookimpl
def register_rollout_engines(register):
    register("sglang", SGLangEngine)
