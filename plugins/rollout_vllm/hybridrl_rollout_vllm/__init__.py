"""vLLM rollout engine for hybridrl: ``rollout: {engine: vllm}``.

Two modes behind one name:

* in-process (default): ``vllm.LLM`` in the training process, sharing its device; weights are
  synced in place after every update and, on GPU, vLLM's sleep mode frees its memory while the
  policy trains (:mod:`hybridrl_rollout_vllm.local`);
* server (``base_url``): a running vLLM OpenAI-compatible server generates; weights reach it
  through files it reloads, or not at all (:mod:`hybridrl_rollout_vllm.server`).
"""

from __future__ import annotations

from hybridrl.components import RolloutEngine, RolloutOutput, SamplingParams
from hybridrl.hookspecs import hookimpl
from hybridrl_rollout_vllm.options import VLLMOptions

__all__ = ["VLLMEngine", "VLLMOptions"]


class VLLMEngine(RolloutEngine):
    """Responses with the logprob of each sampled token under the temperature-scaled policy."""

    Options = VLLMOptions

    def __init__(self, options: VLLMOptions, ctx):
        super().__init__(options, ctx)
        if options.base_url:
            from hybridrl_rollout_vllm.server import ServerEngine

            self.backend = ServerEngine(options, ctx)
        else:
            from hybridrl_rollout_vllm.local import LocalEngine

            self.backend = LocalEngine(options, ctx)

    @classmethod
    def check_launch(cls, options: VLLMOptions, ctx) -> None:
        if not options.base_url:
            from hybridrl_rollout_vllm.local import check_launch

            check_launch(options, ctx)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutOutput:
        return self.backend.generate(prompts, sampling)

    def update_weights(self, named_tensors) -> None:
        self.backend.update_weights(named_tensors)

    def takes_adapter(self, config: dict) -> str | None:
        return self.backend.takes_adapter(config)

    def update_adapter(self, adapter) -> None:
        self.backend.update_adapter(adapter)

    def adapters_per_call(self) -> int:
        return getattr(self.backend, "adapters_per_call", lambda: 1)()  # a server's: one adapter a call

    def memory_options(self, half_prompts: int) -> str:
        return "rollout.gpu_memory_utilization (its share of the GPU) or rollout.engine_kwargs.max_num_seqs"

    def context_length(self) -> int | None:
        """vLLM's max_model_len, as it settled it (for LongRoPE models its default is the original length)."""
        return self.backend.context

    def seeds_each_request(self) -> bool:
        return self.options.seed_requests

    def updates_in_flight(self) -> bool:
        return getattr(self.backend, "updates_in_flight", lambda: False)()

    def runs_apart(self) -> bool:
        return bool(self.options.base_url)  # a server generates in its own process

    def holds_latest_weights(self) -> bool:
        return getattr(self.backend, "holds_latest_weights", lambda: True)()

    def sleep(self) -> None:
        self.backend.sleep()

    def wake_up(self) -> None:
        self.backend.wake_up()

    def close(self) -> None:
        self.backend.close()

    def metrics(self) -> dict[str, float]:
        """The engine's latest timings and sizes (sleep, wake-up, sync buckets), logged each step."""
        return dict(self.backend.stats)


@hookimpl
def register_rollout_engines(register):
    register("vllm", VLLMEngine)
