"""The leaf sections of the run config, and the bases of every section: a section of core keys
(:class:`Strict`), or a component section whose other keys are the named plugin's (:class:`Section`).
:mod:`hybridrl.config` assembles them into the run config."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, PrivateAttr, model_validator

from hybridrl.components import ConfigModel
from hybridrl.errors import ConfigError


class Strict(ConfigModel):
    pass


class Section(ConfigModel):
    """A component section: core keys here, the plugin's keys validated by its Options."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    _options: Any = PrivateAttr(default=None)

    @property
    def options(self):
        """The chosen plugin's validated options (set by :func:`resolve`)."""
        return self._options


class LoraOptions(Strict):
    """LoRA adapters (peft) on the policy: only they train; see docs/lora.md."""

    r: int = Field(16, gt=0, description="Rank of each adapter.")
    alpha: float = Field(32, gt=0, description="Scaling numerator: the adapter's output is multiplied by alpha / r.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input (0 keeps the update exact).")
    target_modules: list[str] | str = Field(
        "all-linear",
        description="Layers that get adapters: names (q_proj, v_proj, ...) or 'all-linear' (every linear layer "
        "but the output layer).",
    )


class EvalSet(Section):
    """A held-out set of ``data.eval``, but for its rewards (:class:`hybridrl.config.EvalSetConfig`): a
    prompt source (its options beside these keys), how its prompts are built (default: as the data
    section builds them), how it is sampled, and what counts as correct (docs/evaluation.md)."""

    name: str = Field(
        pattern=r"^[A-Za-z0-9_.-]+$", description="The set's name in metrics (eval/<name>/...) and file names."
    )
    source: str = Field("hf", description="Prompt source plugin.")
    prompt_column: str | None = Field(None, description="Default: data.prompt_column.")
    answer_column: str | None = Field(None, description="Default: data.answer_column.")
    template: str | None = Field(None, description="Default: data.template.")
    system_prompt: str | None = Field(None, description="Default: data.system_prompt ('' for none).")
    chat_template: bool | None = Field(None, description="Default: data.chat_template.")
    max_prompt_tokens: int | None = Field(None, gt=0, description="Default: data.max_prompt_tokens.")
    breakdown: str | None = Field(
        "data_source",
        description="Row field whose values split the metrics (eval/<name>/<value>/...) where the rows have it "
        "(verl's data_source); null: none.",
    )
    greedy: bool = Field(
        True,
        description="One response per prompt, the most likely token at each position. Engines take temperature > 0 "
        "only, so greedy decoding samples with top_k 1 (every engine then keeps only the most likely token). false: "
        "n samples at temperature, top_p and top_k.",
    )
    n: int = Field(1, gt=0, description="Samples per prompt (greedy: 1).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (greedy: unused).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (greedy: unused).")
    top_k: int = Field(0, ge=0, description="Sample among the k most likely tokens; 0: all (greedy: unused).")
    max_tokens: int | None = Field(None, gt=0, description="Longest response; default rollout.max_tokens.")
    pass_k: list[int] = Field(
        default_factory=list,
        description="The k of each pass@k to report (each at most n), by the unbiased estimator of Chen et al. "
        "2021; mean@n (the fraction of samples that are correct) is always reported.",
    )
    correct_at: float = Field(
        1.0,
        description="A sample counts as correct when its score (the weighted sum of the set's rewards) is at least "
        "this.",
    )
    prompts_per_call: int | None = Field(
        None,
        gt=0,
        description="Prompts per generate call on each rank; default: as many as make the responses of a training "
        "call (trainer.prompts_per_step / ranks x rollout.n), over n.",
    )

    def check(self, where: str) -> None:
        """Settings that contradict each other, as one error naming the set (``where``: data.eval[i])."""
        where = f"{where} (set '{self.name}')"
        if self.greedy and self.n > 1:
            raise ConfigError(
                f"{where}: n={self.n} with greedy decoding (greedy: true, the default), which gives one response "
                "per prompt. Set greedy: false to sample n responses at a temperature."
            )
        fields = type(self).model_fields  # defaults: a run's config.yaml writes every key out
        sampled = [k for k in ("temperature", "top_p", "top_k") if getattr(self, k) != fields[k].default]
        if self.greedy and sampled:
            raise ConfigError(f"{where}: {', '.join(sampled)} set with greedy: true; set greedy: false to sample.")
        bad = [k for k in self.pass_k if not 1 <= k <= self.n]
        if bad:
            raise ConfigError(
                f"{where}: pass_k has k={bad[0]} with n={self.n} samples per prompt; pass@k needs 1 <= k <= n. Raise n "
                f"(with greedy: false) or drop k={bad[0]}."
            )


class AgentConfig(Section):
    """Multi-turn rollouts: the environment plugin (its options are this section's other keys),
    the tools it may call, and the bounds of a trajectory."""

    environment: str = Field(description="Environment plugin (hybridrl plugins lists them): tools, retry, ...")
    max_turns: int = Field(4, gt=0, description="Most assistant turns of a trajectory.")
    max_total_tokens: int | None = Field(
        None,
        gt=0,
        description="Most tokens of a trajectory after its prompt: sampled turns and observations together; "
        "default max_turns x rollout.max_tokens. rollout.max_tokens bounds each turn.",
    )
    tools: list[str] = Field(default_factory=list, description="Tool plugins the model may call (calculator, python).")
    tool_options: dict[str, dict] = Field(
        default_factory=dict, description="Options of each tool, by name: {python: {timeout_s: 5}}."
    )
    parser: str = Field("hermes", description="Tool-call parser plugin: the format the chat template teaches.")
    schedule: Literal["auto", "eager", "turns"] = Field(
        "auto",
        description="eager: a trajectory whose observation is ready goes to the engine at once, without waiting "
        "for the others' tools (reproducible with engines that seed each request: vllm, sglang); turns: every "
        "trajectory's turn k is generated together (reproducible with every engine). auto: eager with engines "
        "that seed each request, else turns.",
    )
    workers: int = Field(8, gt=0, description="Threads that run environment steps and tool calls.")
    _tool_options: dict[str, Any] = PrivateAttr(default_factory=dict)
    _parser_options: Any = PrivateAttr(default=None)


class OnlineConfig(Strict):
    """``hybridrl serve``: answer users with the policy, learn from their ratings (docs/online.md)."""

    update_every: int = Field(16, gt=0, description="Run an update once this many new ratings are in.")
    update_every_s: float = Field(
        0, ge=0, description="Also run one when the oldest untrained rating is this many seconds old; 0: off."
    )
    max_batch: int = Field(256, gt=0, description="Most ratings one update trains on (the oldest first).")
    baseline: Literal["auto", "leave_one_out", "running"] = Field(
        "auto",
        description="Advantage = rating - baseline. leave_one_out: the mean rating of the other answers to the same "
        "prompt in the update; running: the mean of all earlier ratings; auto: leave_one_out where the update "
        "has another answer to the prompt, running otherwise.",
    )
    rating_min: float = Field(0.0, description="Lowest rating accepted; 'down' (thumbs down) stores it.")
    rating_max: float = Field(1.0, description="Highest rating accepted; 'up' (thumbs up) stores it.")
    batch_requests: int = Field(
        16, gt=0, description="Requests that wait while the engine is busy are answered together, up to this many."
    )
    max_request_bytes: int = Field(65536, gt=0, description="Larger request bodies get 413.")
    requests_per_minute: int = Field(120, gt=0, description="Per client address; more get 429.")
    save_every: int = Field(1, gt=0, description="Checkpoint every this many updates (the last one always).")

    @model_validator(mode="after")
    def _range(self):
        if not self.rating_min < self.rating_max:
            raise ValueError(f"online.rating_min={self.rating_min} must be below online.rating_max={self.rating_max}.")
        return self
