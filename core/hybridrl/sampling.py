"""How responses are sampled: the sampling keys of the ``rollout`` section (:class:`Sampling`),
what an engine's ``generate`` receives (:class:`SamplingParams`, with the seed rule of engines that
seed each request), and the settings that leave the distribution as it is (:data:`NEUTRAL_SAMPLING`)."""

from __future__ import annotations

from pydantic import Field

from hybridrl.options import ConfigModel


class Sampling(ConfigModel):
    """How responses are sampled: the sampling keys of the YAML ``rollout`` section, declared once.

    The config validates them there; the trainer hands them to the engine as
    :class:`SamplingParams`, with the step's seed. An engine samples from softmax(logits / T)
    truncated only by ``top_p`` and ``top_k``, and by nothing a model folder's
    ``generation_config.json`` says.
    """

    n: int = Field(8, gt=0, description="Samples per prompt.")
    temperature: float = Field(
        1.0, gt=0, description="Softmax temperature T; the trainer scores responses with softmax(logits / T) too."
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: the smallest top set of this mass.")
    top_k: int = Field(0, ge=0, description="Sample among the k most likely tokens; 0 disables top-k.")
    max_tokens: int = Field(64, gt=0, description="Maximum response length.")
    stop: list[str] = Field(default_factory=list, description="Stop strings.")
    ignore_eos: bool = Field(False, description="Generate exactly max_tokens, past end-of-sequence (benchmarks).")


#: the sampling settings that leave softmax(logits / T) as it is, which engines (vLLM, SGLang) and
#: servers otherwise take from the model folder's generation_config.json: send them with every request
NEUTRAL_SAMPLING = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


class SamplingParams(Sampling):
    """What an engine's ``generate`` receives: :class:`Sampling` and the step's seed."""

    seed: int | None = Field(None, description="Seed of this call's sampling; set by the trainer for each step.")
    seeds: list[int] | None = Field(
        None,
        description="One seed per prompt of the call (sample j of prompt i: seeds[i] + j), instead of seed + i*n: "
        "the agent loop seeds each trajectory's turn whatever call it lands in. Engines that seed each request "
        "(vllm, sglang) honour it exactly; the hf engine seeds the call with the first.",
    )
    adapters: list[str] | None = Field(
        None,
        description="The name of the LoRA adapter that answers each prompt of the call (hybridrl tenants); engines "
        "that mix adapters (RolloutEngine.adapters_per_call) read it, the engine session splits the call for the "
        "others. None: the one adapter of the run.",
    )

    def prompt_seeds(self, prompts: int) -> list[int] | None:
        """The seed of each of ``prompts`` prompts, its sample j seeded ``+ j`` (vLLM's rule for a
        request of n samples): ``seeds`` when set, else ``seed + i·n``; None when unseeded."""
        if self.seeds is not None:
            return list(self.seeds)
        return None if self.seed is None else [self.seed + i * self.n for i in range(prompts)]

    def sample_seeds(self, prompts: int) -> list[int] | None:
        """The seed of each of the ``prompts`` x n samples, grouped by prompt (:meth:`prompt_seeds` + j),
        for engines that take one request per sample (SGLang)."""
        seeds = self.prompt_seeds(prompts)
        return None if seeds is None else [s + j for s in seeds for j in range(self.n)]
