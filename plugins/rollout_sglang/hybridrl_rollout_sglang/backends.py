"""The two ways to reach SGLang: ``sglang.Engine`` in this process, or a running server over HTTP.

Both share the memory cycle of a colocated engine (:class:`Backend`). The engine session calls,
per step (the lifecycle of :class:`hybridrl.components.RolloutEngine`): ``generate`` -> ``sleep``
-> (training) -> ``update_weights`` -> ``wake_up`` at the next ``generate``. On
``sleep`` SGLang's ``release_memory_occupation`` frees the KV cache, the CUDA graphs and
(``release_weights``) the weights. Without SGLang's CPU copy of the weights
(``weights_cpu_backup``) their memory comes back empty, so they come back through the
update: ``update_weights`` first resumes the ``weights`` memory and loads the new tensors
into it, and ``wake_up`` then resumes ``kv_cache`` and ``cuda_graph``. That is verl's order,
and with SGLang 0.5.17 it gave outputs identical to a never-released engine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from hybridrl_http.client import ServiceError, get_json, post_json

from hybridrl.engines import stays_awake
from hybridrl.models import load_model_config
from hybridrl_rollout_sglang.adapters import checked, load_in_process, lora_kwargs, refusal, server_refusal
from hybridrl_rollout_sglang.protocol import COMPONENT

ALL_TAGS = frozenset({"weights", "kv_cache", "cuda_graph"})
CACHE_TAGS = ("kv_cache", "cuda_graph")  # in the order of the GPU-proven resume call
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


class SGLangUnavailableError(RuntimeError):
    """SGLang cannot run here; the message names what failed and what to use instead."""


class Backend:
    """Release/resume bookkeeping shared by both modes; subclasses provide the SGLang calls."""

    in_flight = False  # a sync may land while requests run (a server's in_flight)

    def __init__(self, options):
        self.can_release = False  # set by the subclass from its options
        self.release_weights = options.release_weights
        self.cpu_backup = options.weights_cpu_backup
        self.released: set[str] = set()
        self.weights_lost = False  # released without a CPU copy and not reloaded since

    # primitives
    def _generate(self, request: dict) -> list[dict]:
        raise NotImplementedError

    def _load(self, buckets, version: int) -> None:
        raise NotImplementedError

    def _release(self, tags: list[str] | None) -> None:
        """Release ``tags``; None: all of them."""
        raise NotImplementedError

    def _resume(self, tags: list[str] | None) -> None:
        """Resume ``tags``; None: all of them."""
        raise NotImplementedError

    def shutdown(self) -> None:
        pass

    # the cycle
    def generate_many(self, requests: list[dict]) -> list[dict]:
        """The outputs of several requests, in order."""
        return [item for request in requests for item in self.generate(request)]

    def generate(self, request: dict) -> list[dict]:
        if self.weights_lost:
            raise RuntimeError(
                f"{COMPONENT}: the engine's weights were released by sleep() and no update_weights() "
                "reloaded them (the engine session sends them before it wakes the engine; code that calls "
                "the engine itself must too), so generating now would use garbage. Set "
                "rollout.weights_cpu_backup: true (SGLang keeps a CPU copy while released) or "
                "rollout.release_weights: false (only the KV cache and CUDA graphs are freed)."
            )
        return self._generate(request)

    def sleep(self) -> None:
        if not self.can_release or self.released:
            return
        if self.release_weights:
            self._release(None)  # everything, as the GPU-proven call does
            self.released = set(ALL_TAGS)
            self.weights_lost = not self.cpu_backup
        else:
            self._release(list(CACHE_TAGS))
            self.released = set(CACHE_TAGS)

    def update_weights(self, buckets, version: int) -> None:
        if "weights" in self.released:
            self._resume(["weights"])
            self.released.discard("weights")
        self._load(buckets, version)
        self.weights_lost = False

    def update_adapter(self, adapter, name: str) -> None:
        """Serve ``adapter`` (:class:`hybridrl.lora.Adapter`) under ``name`` from now on, the one before unloaded."""
        if "weights" in self.released:  # kept (weights_cpu_backup) or never released: adapters need the base
            self._resume(["weights"])
            self.released.discard("weights")
        self._load_adapter(adapter, name)

    def _load_adapter(self, adapter, name: str) -> None:
        raise NotImplementedError

    def adapter_refusal(self, config: dict) -> str | None:
        return "it loads full weights only"

    def wake_up(self) -> None:
        if not self.released:
            return
        self._resume(None if self.released == ALL_TAGS else list(CACHE_TAGS))
        self.released = set()


# -- in-process ---------------------------------------------------------------------------------


def cuda_available() -> bool:
    return torch.cuda.is_available()


INSTALL = (
    "Install it on the GPU machine with: pip install 'hybridrl-rollout-sglang[gpu]' (sglang>=0.5, which pins its "
    "own torch); or set rollout.base_url to a running SGLang server; or use rollout.engine: vllm or hf."
)


def unavailable() -> str | None:
    """Why the in-process engine cannot run on this machine and what to use instead, without importing
    SGLang; None where it can."""
    if not cuda_available():
        return (
            f"the in-process engine needs a CUDA GPU, and torch {torch.__version__} sees none. SGLang has no CPU "
            "build on PyPI. Use rollout.engine: vllm or hf on this machine, or set rollout.base_url to a running "
            "SGLang server."
        )
    if "sglang" in sys.modules:  # imported already (or blocked: None)
        return None if sys.modules["sglang"] is not None else f"SGLang is not installed. {INSTALL}"
    return None if importlib.util.find_spec("sglang") is not None else f"SGLang is not installed. {INSTALL}"


def import_sglang():
    """``sglang``, or an error that says why it cannot run here and what to use instead."""
    if not cuda_available():
        raise SGLangUnavailableError(f"{COMPONENT}: {unavailable()}")
    try:
        import sglang
    except Exception as e:  # ImportError, or a broken kernel package failing at import
        raise SGLangUnavailableError(f"{COMPONENT}: 'import sglang' failed ({type(e).__name__}: {e}). {INSTALL}") from e
    return sglang


def engine_kwargs(options, ctx) -> dict:
    """Keyword arguments of ``sglang.Engine`` from the plugin's options (``enable_memory_saver``
    decided: :func:`memory_saver`) and the run."""
    kwargs = {
        "model_path": ctx.model_path,
        "skip_tokenizer_init": options.skip_tokenizer_init,
        "mem_fraction_static": options.mem_fraction_static,
        "tp_size": options.tp_size,
        "dtype": options.dtype,
        "random_seed": ctx.seed,
        "enable_memory_saver": options.enable_memory_saver,
        "log_level": options.log_level,
        "trust_remote_code": ctx.trust_remote_code,
    }
    if options.weights_cpu_backup:
        kwargs["enable_weights_cpu_backup"] = True
    if options.context_length is not None:
        kwargs["context_length"] = options.context_length
    if options.attention_backend is not None:
        kwargs["attention_backend"] = options.attention_backend
    if ctx.responses_per_call:
        # decoding batches above SGLang's largest CUDA graph (256 on an H200 by default) run without
        # graphs: capture them up to the batch the trainer sends (multiples of 8, as SGLang's list)
        kwargs["cuda_graph_max_bs_decode"] = -(-ctx.responses_per_call // 8) * 8
    if ctx.device.type == "cuda" and ctx.device.index:
        kwargs["base_gpu_id"] = ctx.device.index  # colocate with the policy
    if ctx.world_size > 1:  # an engine per rank: each node's engines need ports of their own
        kwargs["port"] = 30000 + 100 * ctx.local_rank
        kwargs["nccl_port"] = 30050 + 100 * ctx.local_rank
    own = set(kwargs) - {"port", "nccl_port", "cuda_graph_max_bs_decode"}  # engine_kwargs may set these
    kwargs |= lora_kwargs(ctx)[0]  # SGLang's LoRA, where the run syncs adapters (engine_kwargs may change it)
    clash = sorted(set(options.engine_kwargs) & (own | {"model_path", "random_seed"}))
    if clash:
        raise ValueError(
            f"{COMPONENT}: engine_kwargs sets {', '.join(clash)}, which the plugin sets itself. Use the "
            "plugin options (rollout.mem_fraction_static, rollout.tp_size, ...), model.path and trainer.seed."
        )
    return {**kwargs, **options.engine_kwargs}


def memory_saver(options, ctx) -> bool:
    """``enable_memory_saver``; ``auto``: off where the engine may keep its memory while the policy
    trains (:func:`hybridrl.engines.stays_awake`), else on (and on off a CUDA device)."""
    if options.enable_memory_saver != "auto":
        return options.enable_memory_saver
    if ctx.device.type != "cuda":
        return True
    awake, why = stays_awake(options.mem_fraction_static, ctx)
    if ctx.is_main:
        then = (
            "the engine keeps its memory; set enable_memory_saver: true to release it while the policy trains"
            if awake
            else "the engine releases its memory while the policy trains; set enable_memory_saver: false to keep it"
        )
        print(f"{COMPONENT}: enable_memory_saver auto: {not awake}, as {why}: {then}", flush=True)
    return not awake


def engine_dtype(options, ctx) -> str:
    """The dtype SGLang runs the weights in: ``dtype``, or for ``auto`` SGLang's own rule
    (``_get_and_verify_dtype`` in sglang/srt/configs/model_config.py): the checkpoint's dtype, but
    float16 for a float32 checkpoint (bfloat16 for Gemma's)."""
    if options.dtype != "auto":
        return options.dtype
    config = load_model_config(ctx.model_path, ctx.trust_remote_code)
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    saved = str(saved).removeprefix("torch.")
    if saved != "float32":
        return saved
    return "bfloat16" if config.model_type.startswith("gemma") else "float16"


class InProcess(Backend):
    """``sglang.Engine`` started in this process (its scheduler runs in child processes)."""

    def __init__(self, options, ctx):
        super().__init__(options)
        self.options = options
        self.can_release = memory_saver(options, ctx)
        policy = str(ctx.dtype).removeprefix("torch.")
        if options.dtype == "auto" and ctx.is_main and (dtype := engine_dtype(options, ctx)) != policy:
            print(
                f"{COMPONENT}: dtype auto: {dtype}, SGLang's choice for this checkpoint, beside a {policy} "
                "policy: the weights are rounded at each sync (rollout/logprob_diff_mean shows it); set dtype: "
                "bfloat16 or float16 to choose",
                flush=True,
            )
        sglang = import_sglang()
        update = {"enable_memory_saver": self.can_release}
        if lora_kwargs(ctx)[0] and self.can_release and self.release_weights and not self.cpu_backup:
            update["weights_cpu_backup"] = self.cpu_backup = True  # adapter syncs never send the base again
        kwargs = engine_kwargs(options.model_copy(update=update), ctx)
        try:
            self.engine = sglang.Engine(**kwargs)
        except Exception as e:
            raise RuntimeError(
                f"{COMPONENT}: sglang.Engine failed to start ({type(e).__name__}: {e}). Engine arguments: "
                f"{kwargs}. Out of memory: lower mem_fraction_static or context_length. A kernel or "
                "backend error: try attention_backend: triton. Check the log lines above for the child "
                "process that failed."
            ) from e
        self.dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(options.dtype)
        self.gc_frozen = False
        self.lora, self.lora_why = kwargs, lora_kwargs(ctx)[1]
        self.adapter: str | None = None  # the name SGLang serves the policy's adapter under
        self.folder: Path | None = None  # adapters as peft folders, where SGLang cannot take tensors

    def adapter_refusal(self, config):
        if not self.lora.get("enable_lora"):
            return self.lora_why or "engine_kwargs turned LoRA off"
        if self.can_release and self.release_weights and not self.cpu_backup:
            return ("release_weights drops the base weights while the policy trains, and adapter syncs never send them "
                    "again (set rollout.weights_cpu_backup: true or release_weights: false)")  # fmt: skip
        return refusal(config, self.lora.get("max_lora_rank"), self.lora.get("lora_target_modules"))

    def _load_adapter(self, adapter, name):
        self.folder = load_in_process(self.engine, adapter, name, self.adapter, self.folder)
        self.adapter = name

    def _generate(self, request):
        out = self.engine.generate(**request)
        if not self.gc_frozen and hasattr(self.engine, "freeze_gc"):
            # SGLang's advice once it has served requests (its long-GC warning: "latency jitter"): the objects
            # of its scheduler and of this process kept out of full garbage collections from now on
            self.engine.freeze_gc()
            self.gc_frozen = True
        return out if isinstance(out, list) else [out]

    def _load(self, buckets, version):
        pending = None
        for bucket in buckets:
            if pending is not None:
                self._send(pending, flush_cache=False)
            pending = bucket
        if pending is not None:
            self._send(pending, flush_cache=True)  # one flush of the prefix cache, after the last bucket

    def _send(self, bucket, flush_cache):
        tensors = [(n, t.detach() if self.dtype is None else t.detach().to(self.dtype)) for n, t in bucket]
        if any(t.is_cuda for _, t in tensors):
            # SGLang's scheduler reads these through CUDA IPC from another process, on its own stream:
            # the optimizer step and the dtype casts queued on ours must be finished first.
            torch.cuda.synchronize()
        ret = self.engine.update_weights_from_tensor(named_tensors=tensors, flush_cache=flush_cache)
        if isinstance(ret, (tuple, list)) and ret and ret[0] is False:
            raise RuntimeError(
                f"{COMPONENT}: update_weights_from_tensor failed for {len(tensors)} tensors "
                f"({tensors[0][0]}...): {ret[1] if len(ret) > 1 else ret}. The policy's tensor names must "
                "be the Hugging Face names of the model SGLang loaded."
            )

    def _release(self, tags):
        if tags is None:
            self.engine.release_memory_occupation()
        else:
            self.engine.release_memory_occupation(tags=tags)

    def _resume(self, tags):
        if cuda_available():
            torch.cuda.empty_cache()  # hand the training's cached blocks back before SGLang maps its memory
        if tags is None:
            self.engine.resume_memory_occupation()
        else:
            self.engine.resume_memory_occupation(tags=tags)

    def shutdown(self):
        self.engine.shutdown()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


# -- server ------------------------------------------------------------------------------------


class Server(Backend):
    """A running SGLang server, through its native API (``/generate``, ``/update_weights_from_disk``).
    With ``in_flight`` a sync retracts the running requests (``/pause_generation``, mode ``retract``:
    back to the queue with the tokens they have), loads, and lets them go on (``/continue_generation``),
    their prompts and tokens prefilled again under the new weights."""

    def __init__(self, options, ctx):
        super().__init__(options)
        self.options = options
        self.url = options.base_url.rstrip("/")
        self.component = f"{COMPONENT} (server {self.url})"
        self.can_release = options.release_memory_on_sleep
        self.model_path = ctx.model_path
        self.weights_dir = Path(options.weights_dir or ctx.run_dir / "sglang_weights").absolute()
        self.current: Path | None = None
        self.adapter: str | None = None  # the name the server serves the policy's adapter under
        try:
            info = get_json(f"{self.url}/get_model_info", **self._http())
        except ServiceError as e:
            raise ServiceError(
                f"{e} Start one with: python -m sglang.launch_server --model-path {ctx.model_path} "
                "--port 30000 (add --enable-memory-saver for release_memory_on_sleep), and set "
                "rollout.base_url to it."
            ) from None
        if isinstance(info, dict) and info.get("is_generation") is False:
            raise ServiceError(f"{self.component}: the server runs an embedding/reward model, not a generator.")
        self.in_flight = self._check_in_flight(ctx)

    def _check_in_flight(self, ctx) -> bool:
        """Whether syncs land while requests run (``in_flight``); 'auto' says once why not, 'on' fails."""
        if self.options.in_flight == "off":
            return False
        why = self._in_flight_refusal(ctx)
        if why and self.options.in_flight == "on":
            raise ServiceError(
                f"{self.component}: rollout.in_flight is 'on', but {why}; or set rollout.in_flight: auto."
            )
        if why and ctx.rank == 0:
            print(f"note: {self.component}: weight syncs wait for the requests in flight: {why}.", file=sys.stderr,
                  flush=True)  # fmt: skip
        return not why

    def _in_flight_refusal(self, ctx) -> str | None:
        if self.can_release:
            return "release_memory_on_sleep frees the memory that requests in flight hold"
        if ctx.lora is not None:
            return "model.lora is set, and an adapter sync unloads the adapter that requests in flight use"
        try:
            self._post("/continue_generation", {})  # nothing to continue: a server that has it answers 200
        except ServiceError as e:
            if "HTTP 404" not in str(e):
                raise
            return f"{self.url} has no /pause_generation and /continue_generation (SGLang 0.5 has them)"
        return None

    def _http(self, timeout=None):
        o = self.options
        return dict(component=self.component, timeout=timeout or o.timeout, retries=o.retries, token=o.api_key)

    def _post(self, path, payload, timeout=None):
        return post_json(f"{self.url}{path}", payload, **self._http(timeout))

    def generate_many(self, requests: list[dict]) -> list[dict]:
        """Requests in order; up to ``concurrency`` in flight (SGLang batches them continuously)."""
        if len(requests) == 1 or self.options.concurrency == 1:
            return super().generate_many(requests)
        with ThreadPoolExecutor(self.options.concurrency) as pool:
            parts = list(pool.map(self.generate, requests))
        return [item for part in parts for item in part]

    def _generate(self, request):
        out = self._post("/generate", request)
        return out if isinstance(out, list) else [out]

    def _load(self, buckets, version):
        """Save the tensors as a Hugging Face folder and ask the server to load it from disk."""
        from safetensors.torch import save_file

        folder = self.weights_dir / f"v{version:06d}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for f in Path(self.model_path).iterdir():  # config, generation config, tokenizer
            if f.is_file() and not f.name.endswith(WEIGHT_FILES) and not f.name.endswith(".index.json"):
                shutil.copy2(f, folder / f.name)
        weight_map, total = {}, 0
        for k, bucket in enumerate(buckets):
            name = f"model-{k + 1:05d}.safetensors"
            tensors = {n: t.detach().to("cpu").contiguous() for n, t in bucket}
            save_file(tensors, str(folder / name), metadata={"format": "pt"})
            weight_map |= dict.fromkeys(tensors, name)
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        seen_by_server = folder
        if self.options.server_weights_dir:
            seen_by_server = Path(self.options.server_weights_dir) / folder.name
        payload = {"model_path": str(seen_by_server)} | ({"weight_version": str(version)} if self.in_flight else {})
        if self.in_flight:  # the running requests back to the queue, their tokens kept
            self._post("/pause_generation", {"mode": "retract"})
        try:
            ret = self._post("/update_weights_from_disk", payload)
        except ServiceError as e:
            raise ServiceError(
                f"{e} The server must see {seen_by_server} (a shared file system; set "
                "rollout.server_weights_dir when it mounts rollout.weights_dir elsewhere)."
            ) from None
        finally:
            if self.in_flight:
                self._post("/continue_generation", {})
        if isinstance(ret, dict) and ret.get("success") is False:
            raise ServiceError(f"{self.component}: update_weights_from_disk failed: {ret.get('message')}")
        if self.current is not None and self.current != folder:
            shutil.rmtree(self.current, ignore_errors=True)
        self.current = folder

    def adapter_refusal(self, config):
        if self.can_release:
            return "release_memory_on_sleep may drop the server's base weights, which adapter syncs never send again"
        return server_refusal(get_json(f"{self.url}/get_server_info", **self._http()), config)

    def _load_adapter(self, adapter, name):
        """peft's folder under weights_dir/adapters, loaded by the server under ``name``; the one before unloaded."""
        folder = adapter.save(self.weights_dir / "adapters" / name)
        seen = Path(self.options.server_weights_dir) / "adapters" / name if self.options.server_weights_dir else folder
        checked(self._post("/load_lora_adapter", {"lora_name": name, "lora_path": str(seen)}), self.component,
                f"loading adapter {name} from {seen}")  # fmt: skip
        if self.adapter is not None:
            self._post("/unload_lora_adapter", {"lora_name": self.adapter})
            shutil.rmtree(self.weights_dir / "adapters" / self.adapter, ignore_errors=True)
        self.adapter = name

    def _release(self, tags):
        self._post("/release_memory_occupation", {} if tags is None else {"tags": tags})

    def _resume(self, tags):
        self._post("/resume_memory_occupation", {} if tags is None else {"tags": tags})


def original_logprob_env() -> bool:
    """Whether SGLang was told to return logprobs before the temperature (in this process's env)."""
    return os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes")
