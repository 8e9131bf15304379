"""Methods added to vLLM's workers (``worker_extension_cls``): the worker side of the weight sync.

Every bucket goes through :meth:`WeightReceiver.hybridrl_load`. With the engine in the training
process (vLLM's UniProcExecutor) the bucket arrives as the list of the trainer's tensors, by
reference; with tensor parallelism, or with VLLM_ENABLE_V1_MULTIPROCESSING=1, the workers live
in other processes where tensors sent through ``collective_rpc`` do not survive the trip, so the
bucket travels as safetensors bytes and each worker loads it into its shard of the model.

Two ways to load (the ``weight_sync`` option):

* ``load_weights``: the model's own ``load_weights``; each vLLM parameter's ``weight_loader``
  copies an HF tensor into its slice of the fused parameter (q/k/v_proj into qkv_proj,
  gate/up_proj into gate_up_proj), converting the dtype. Nothing runs after loading, so this is
  exact only where the engine computes with the very tensors that were loaded:
  :meth:`WeightReceiver.hybridrl_load_weights_blockers` says where it is not.
* ``reload_weights``: vLLM's layerwise reload, which restores each layer in checkpoint format,
  loads it and re-runs the post-processing (quantization, CPU GEMM packing), then copies the
  result into the tensors the engine uses. Exact everywhere, slower.
"""

from __future__ import annotations

import torch

METHODS = ("load_weights", "reload_weights")
# post-processing that leaves the loaded tensors as they are (CUDA) or that we check (CPU)
PLAIN_QUANT_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")
CHECKED_PLATFORMS = ("cuda", "cpu")


class WeightReceiver:
    def hybridrl_load(self, bucket: list[tuple[str, torch.Tensor]] | bytes, method: str) -> int:
        """Load one bucket of HF-named tensors in place with ``method`` (one of ``METHODS``);
        ``bucket`` is the tensors themselves or safetensors bytes. Returns how many tensors it held."""
        if isinstance(bucket, bytes):
            from safetensors.torch import load

            bucket = list(load(bucket).items())
        if method == "reload_weights":
            tied = getattr(self.vllm_config.model_config.hf_text_config, "tie_word_embeddings", False)
            bucket = with_tied_head(self.model_runner.get_model(), bucket, tied)
            self.reload_weights(weights_iterator=iter(bucket), is_checkpoint_format=True)
            repack_cpu_experts(self.model_runner.get_model(), [name for name, _ in bucket])
        elif method == "load_weights":
            from vllm.config import set_current_vllm_config

            model = self.model_runner.get_model()
            if not hasattr(self, "_hybridrl_tied"):
                from hybridrl.engine_weights import tied_aliases

                self._hybridrl_tied = tied_aliases(model)
            # a tied alias (lm_head.weight) is its canonical tensor, which loads under its own name;
            # vLLM 0.32's loader refuses a call that brings the alias without it
            weights = [(name, t) for name, t in bucket if name not in self._hybridrl_tied]
            with torch.no_grad(), set_current_vllm_config(self.vllm_config):
                model.load_weights(weights=iter(weights))
            self.model_runner.reset_encoder_cache()  # multimodal encoder outputs of the old weights
        else:
            raise ValueError(f"Unknown weight load method '{method}'. Available: {', '.join(METHODS)}.")
        return len(bucket)

    def hybridrl_add_adapter(self, request, tensors, config: dict) -> bool:
        """Add the LoRA adapter of ``request`` from ``tensors`` (the trainer's, or safetensors bytes) and peft's
        ``config``, without a folder: :func:`hybridrl_rollout_vllm.adapters.add_from_tensors`."""
        from hybridrl_rollout_vllm.adapters import add_from_tensors

        return add_from_tensors(self.model_runner.lora_manager, request, tensors, config)

    def hybridrl_load_weights_blockers(self) -> list[str]:
        """Why ``load_weights`` would not be exact on this worker; an empty list when it is.

        ``load_weights`` writes into the parameters the model has after loading. It misses any
        state that post-processing derived from them: quantized or repacked weights, MoE kernel
        layouts, MLA's absorbed matrices, and on CPU the GEMM weights that vLLM packs for oneDNN
        (it then keeps empty parameters for the linear layers, and a packed copy of lm_head).
        """
        from vllm.platforms import current_platform

        model_config = self.vllm_config.model_config
        reasons = []
        platform = next((p for p in CHECKED_PLATFORMS if getattr(current_platform, f"is_{p}")()), None)
        if platform is None:
            reasons.append(f"post-processing on {type(current_platform).__name__} is not checked (only CUDA and CPU)")
        if model_config.quantization:
            reasons.append(f"the model is quantized ({model_config.quantization})")
        if self.vllm_config.lora_config is not None:
            reasons.append("LoRA wraps the model's layers")
        found: dict[str, list[str]] = {}
        for name, module in self.model_runner.get_model().named_modules():
            quant = getattr(module, "quant_method", None)
            if quant is not None and type(quant).__name__ not in PLAIN_QUANT_METHODS:
                why = f"{type(quant).__name__} processes weights after loading"
            elif quant is None and callable(getattr(module, "process_weights_after_loading", None)):
                if type(module).__name__ == "Attention":  # plain attention derives nothing from weights
                    continue
                why = f"{type(module).__name__} processes weights after loading"
            elif platform == "cpu" and getattr(module, "cpu_linear", None) not in (None, torch.nn.functional.linear):
                why = "vLLM's CPU backend packed the weights for its GEMM kernels after loading"
            else:
                continue
            found.setdefault(why, []).append(name or type(module).__name__)
        for why, names in found.items():
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            reasons.append(f"{why}: {names[0]}{more}")
        return reasons


def repack_cpu_experts(model: torch.nn.Module, names: list[str]) -> int:
    """Prepack again the expert weights of the MoE layers that a reload brought (``names``: the
    bucket's checkpoint names); returns how many layers.

    vLLM's CPU MoE kernel packs expert weights for its grouped GEMM once, when the model loads.
    Its reload of a weight update re-runs the layer's post-processing but skips that step (it is
    set up once, for CUDA graphs' sake), and copies the plain layout into the packed tensors: the
    engine then computes with scrambled experts (a mean logprob error of 0.9 nats after syncing
    the very weights it had). On other platforms nothing is packed and this does nothing.
    """
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # another vLLM layout: nothing known to repack
        return 0
    from hybridrl.engines import layer_of

    layers = tuple(layer_of(name) + "." for name in names)
    count = 0
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and (name + ".").startswith(layers):
            experts.process_weights_after_loading(module)
            count += 1
    return count


def with_tied_head(model: torch.nn.Module, bucket: list, tied: bool) -> list:
    """``bucket`` with the tied output layer's weight added beside the input embedding, where
    the engine's model has an output layer of its own that ties to the embedding.

    The trainer sends a tied weight once, under the embedding's name (the checkpoint's format).
    vLLM's Llama ties ``lm_head`` to the embedding's parameter but keeps it a module of its own,
    whose post-processing (on CPU, its packed GEMM copy) runs only when ``lm_head.weight`` itself
    is reloaded Gemma-2 has no ``lm_head`` at all.
    """
    head = getattr(model, "lm_head", None)
    if not tied or head is None:
        return bucket
    if any(name == "lm_head.weight" for name, _ in bucket):
        return bucket
    from hybridrl_rollout_vllm.weights import EMBEDDINGS

    embedding = next((t for name, t in bucket if name.endswith(EMBEDDINGS)), None)
    return bucket if embedding is None else [*bucket, ("lm_head.weight", embedding)]
