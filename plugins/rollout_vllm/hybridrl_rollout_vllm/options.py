"""Options of the ``vllm`` rollout engine (keys of the YAML ``rollout`` section)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from hybridrl.components import Options
from hybridrl.options import Secret

LOCAL_ONLY = (
    "gpu_memory_utilization",
    "tensor_parallel_size",
    "max_model_len",
    "enforce_eager",
    "dtype",
    "seed",
    "engine_kwargs",
    "sleep_level",
    "cpu_kv_cache_gb",
    "cpu_threads",
    "weight_sync",
)
SERVER_ONLY = (
    "api_key", "served_model", "timeout", "retries", "server_weights", "server_weights_dir", "sync_every", "in_flight"
)  # fmt: skip


class VLLMOptions(Options):
    # -- the in-process engine (vllm.LLM in the training process) --------------------------
    gpu_memory_utilization: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Fraction of GPU memory vLLM may take for weights and KV cache. The engine shares "
        "the GPU with training, so leave room for the policy, its gradients and optimizer state. "
        "Ignored on CPU, where cpu_kv_cache_gb sizes the KV cache.",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="Devices one engine spans (vLLM tensor parallelism). Under torchrun: that many consecutive "
        "training ranks form one engine (vLLM's external launcher; it must divide the world size), each loading "
        "its slice of the gathered weights. Without torchrun, above 1 vLLM runs worker processes on this "
        "machine's GPUs and weights travel to them as safetensors bytes, one bucket at a time.",
    )
    max_model_len: int | None = Field(
        None,
        gt=0,
        description="Longest prompt + response in tokens; default: the model's own limit. Lower it "
        "to shrink the KV cache the engine reserves.",
    )
    enforce_eager: bool | None = Field(
        None,
        description="Run without CUDA graphs / compilation. Default: true on CPU, false on GPU "
        "(CUDA graphs make decoding faster but take longer to start).",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Dtype of the engine's weights; 'auto' takes model.dtype (the policy's). A lower "
        "precision than the policy's shows up in rollout/logprob_diff_*.",
    )
    seed: int | None = Field(
        None,
        description="Seed of the engine's own random state; default trainer.seed. Each generate call "
        "also seeds its requests from the trainer's per-step seed (seed_requests), so runs are reproducible.",
    )
    seed_requests: bool = Field(
        True,
        description="Give every request its own seed, from the trainer's per-step seed: runs and resumes are "
        "reproducible sample for sample, whatever the batching. vLLM then samples the seeded requests one by "
        "one at every token: on one H200, 64 completions of the 0.5B shape took 0.72 s seeded against 0.54 s "
        "unseeded. false: requests carry no seed and draw from the engine's own random state (faster; samples "
        "then differ from run to run and after a resume). Also in server mode.",
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra keyword arguments for vllm.LLM, passed as they are and overriding the "
        "plugin's own choices (e.g. {max_num_seqs: 128, quantization: fp8}).",
    )
    update_bucket_mb: float = Field(
        2048,
        gt=0,
        description="Weight sync bucket size in MiB. The trainer's tensors are grouped into buckets of "
        "whole decoder layers of about this size and each bucket is loaded in one call, so the extra "
        "memory a sync holds is at most one bucket plus one layer (with the single strategy the tensors "
        "are the policy's own, and a bucket holds no copies). Fewer calls sync faster: reload_weights, "
        "0.5B model on an H200, 4 buckets of 512 MiB 0.16 s, 1 bucket 0.12 s. In server mode: the size of "
        "each safetensors shard written for the server.",
    )
    weight_sync: Literal["auto", "load_weights", "reload_weights"] = Field(
        "auto",
        description="How each weight-sync bucket is loaded into the engine. 'load_weights': the model's own "
        "load_weights writes the trainer's tensors into vLLM's (fused) parameters in place, nothing more "
        "(fast; exact only where vLLM computes with the parameters it loaded: unquantized dense models on "
        "CUDA, or on CPU without packed GEMM weights); the engine refuses to start where it would not be "
        "exact. 'reload_weights': vLLM's reload_weights, which also re-runs the post-processing after loading "
        "(quantization, MoE kernel layouts, the CPU backend's packed weights); exact everywhere, slower. "
        "'auto': load_weights where it is exact, else reload_weights (on CPU vLLM packs linear weights for "
        "oneDNN, so reload_weights).",
    )
    prefix_caching: bool = Field(
        False,
        description="vLLM's prefix caching. The weights change at every step, so cached prompts are stale "
        "after each sync and the cache must be reset then, a pass over every KV-cache block (0.08 s on an "
        "H200 with 30% of its memory for KV cache); without it, the samples of a prompt each prefill it.",
    )
    sleep_level: Literal["auto", 0, 1, 2] = Field(
        "auto",
        description="vLLM sleep mode used between generation and training (GPU only): 1 offloads the "
        "weights to CPU memory and drops the KV cache; 2 drops both (faster; safe because the trainer "
        "sends every weight after each update); 0 keeps everything on the GPU, which saves the sleep, the "
        "wake-up and the training passes' memory allocations at every step. 'auto': 0 when vLLM's share "
        "(gpu_memory_utilization) and the policy's training state (float32 weights, gradients and AdamW "
        "moments) leave at least a quarter of the GPU for the passes, else 1. On CPU sleep and wake-up do "
        "nothing (vLLM has no sleep mode there).",
    )
    cpu_kv_cache_gb: int | None = Field(
        None,
        ge=1,
        description="KV cache size in GiB on CPU (vLLM's VLLM_CPU_KVCACHE_SPACE); default: that "
        "environment variable when set, else 1.",
    )
    cpu_threads: int = Field(
        1,
        ge=1,
        description="torch/OpenMP threads while the engine generates or loads weights on CPU; the "
        "trainer's own thread count is restored afterwards. More than one thread made vLLM's CPU "
        "decoding many times slower on a 2-core machine.",
    )
    # -- server mode (an existing vLLM OpenAI-compatible server) ---------------------------
    base_url: str | None = Field(
        None,
        description="Use a running vLLM OpenAI-compatible server instead of an in-process engine, "
        "e.g. http://127.0.0.1:8000 (requests go to /v1/completions with token-id prompts). Start "
        "it with --logprobs-mode processed_logprobs so its logprobs follow the trainer's convention.",
    )
    api_key: Secret | None = Field(
        None,
        description="Bearer token for the server (its --api-key). The run's config.yaml shows it as '<redacted>'; "
        "give it as '${env:VLLM_API_KEY}' (any variable name) to keep it out of the YAML too. Redirects are not "
        "followed, so it goes to base_url's host only.",
    )
    served_model: str | None = Field(
        None, description="Model name sent to the server; default: the first model of its /v1/models."
    )
    timeout: float = Field(600, gt=0, description="Seconds one server request may take before it is retried.")
    retries: int = Field(2, ge=0, description="Retries of a failed server request (connection errors, 5xx).")
    server_weights: Literal["reload", "frozen"] = Field(
        "reload",
        description="How trained weights reach the server. 'reload': every sync_every updates the "
        "engine writes the policy as safetensors into server_weights_dir and asks the server to "
        "reload them in place (POST /collective_rpc, reload_weights; the server must run with "
        "VLLM_SERVER_DEV_MODE=1 and see that directory). 'frozen': the server keeps its weights and "
        "the run is off-policy from the first update on (a warning says so).",
    )
    server_weights_dir: str | None = Field(
        None,
        description="Directory, visible to the server under the same path, for the weights it "
        "reloads; default: <run_dir>/vllm_server_weights.",
    )
    sync_every: int = Field(
        1,
        ge=1,
        description="Server mode: send weights every this many updates (between them the server "
        "samples from older weights, which rollout/logprob_diff_* shows).",
    )
    in_flight: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Server mode: a sync lands while requests run (rollout.async does not wait for the batches "
        "generated ahead): the server pauses between two decoding steps, reloads, prefills its requests again "
        "under the new weights and goes on; each token records the weights that sampled it. Needs "
        "VLLM_SERVER_DEV_MODE=1 and --enable-scale-out. 'auto': where the server offers it (else syncs wait, "
        "saying why once); 'on': required; 'off': syncs wait.",
    )

    @model_validator(mode="after")
    def _check_mode(self):
        local = [k for k in LOCAL_ONLY if self.changed(k)]
        if self.base_url:
            if local:
                raise ValueError(
                    f"{', '.join(local)} configure the in-process engine and have no effect with base_url "
                    "(server mode); set them on the vLLM server, or remove base_url."
                )
        else:
            server = [k for k in SERVER_ONLY if self.changed(k)]
            if server:
                raise ValueError(
                    f"{', '.join(server)} only apply with base_url (server mode); set base_url or remove them."
                )
        return self


def capture_sizes(responses: int | None) -> list[int] | None:
    """The batch sizes vLLM captures CUDA graphs for when a run asks for at most ``responses`` at once
    (one generate call's responses: vLLM's decoding batches never hold more): vLLM's own ladder (1, 2,
    4, then every multiple of 8) up to that many, instead of up to its default of 512 whatever the
    run. ``None`` (not known): vLLM's default."""
    if not responses:
        return None
    top = -(-responses // 8) * 8
    return [s for s in (1, 2, 4) if s < top] + list(range(8, top + 1, 8))
