"""The two ways to reach SGLang: ``sglang.Engine`` in this process (:class:`InProcess`), or a running
server over HTTP (:class:`hybridrl_rollout_sglang.server.Server`).

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
import os
import shutil
import sys
from pathlib import Path

import torch

from hybridrl.engines import stays_awake
from hybridrl.models import load_model_config
from hybridrl_rollout_sglang.adapters import checked, load_in_process, lora_kwargs, refusal
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
        """Load ``adapter`` (:class:`hybridrl.lora.Adapter`) under ``name``, beside those loaded before
        (the engine unloads them with :meth:`unload_adapter` once nothing in flight uses them)."""
        if "weights" in self.released:  # kept (weights_cpu_backup) or never released: adapters need the base
            self._resume(["weights"])
            self.released.discard("weights")
        self._load_adapter(adapter, name)

    def _load_adapter(self, adapter, name: str) -> None:
        raise NotImplementedError

    def unload_adapter(self, name: str) -> None:
        raise NotImplementedError

    def adapter_refusal(self, config: dict) -> str | None:
        return "it loads full weights only"

    def loras_per_batch(self) -> int:
        """How many adapters one batch of the engine mixes (SGLang's max_loras_per_batch)."""
        return 1

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
        self.folder: Path | None = None  # adapters as peft folders, where SGLang cannot take tensors

    def adapter_refusal(self, config):
        if not self.lora.get("enable_lora"):
            return self.lora_why or "engine_kwargs turned LoRA off"
        if self.can_release and self.release_weights and not self.cpu_backup:
            return ("release_weights drops the base weights while the policy trains, and adapter syncs never send them "
                    "again (set rollout.weights_cpu_backup: true or release_weights: false)")  # fmt: skip
        return refusal(config, self.lora.get("max_lora_rank"), self.lora.get("lora_target_modules"))

    def _load_adapter(self, adapter, name):
        self.folder = load_in_process(self.engine, adapter, name, self.folder)

    def loras_per_batch(self):
        return int(self.lora.get("max_loras_per_batch") or 1)

    def unload_adapter(self, name):
        checked(self.engine.unload_lora_adapter(lora_name=name), COMPONENT, f"unloading adapter {name}")
        if self.folder is not None:
            shutil.rmtree(self.folder / name, ignore_errors=True)

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


def original_logprob_env() -> bool:
    """Whether SGLang was told to return logprobs before the temperature (in this process's env)."""
    return os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes")
