"""Methods added to vLLM's workers (``worker_extension_cls``) for engines that run in other processes.

With tensor parallelism, or with VLLM_ENABLE_V1_MULTIPROCESSING=1, the workers live in other
processes and tensors sent through ``collective_rpc`` do not survive the trip; a bucket travels
as safetensors bytes instead and each worker loads it into its shard of the model.
"""

from __future__ import annotations


class WeightReceiver:
    def hybridrl_load_bucket(self, payload: bytes) -> int:
        """Load one bucket of HF-named tensors in place; returns how many tensors it held."""
        from safetensors.torch import load

        tensors = load(payload)
        self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        return len(tensors)
