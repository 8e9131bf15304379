"""The leaf sections of the run config, and the bases of every section: a section of core keys
(:class:`Strict`), or a component section whose other keys are the named plugin's (:class:`Section`);
the top-level sections plugins own (:func:`plugin_sections`). :mod:`hybridrl.config` assembles them
into the run config."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from hybridrl import plugins
from hybridrl.components import ConfigModel
from hybridrl.config_files import keys_of, options_error
from hybridrl.errors import ConfigError, did_you_mean


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
    path: str | None = Field(
        None,
        description="A peft adapter folder (adapter_config.json, adapter_model.safetensors) to start from: its rank, "
        "alpha and target modules are the folder's, and its tensors must fit the base model.",
    )
    sync: Literal["auto", "adapter", "merged"] = Field(
        "auto",
        description="What a weight sync sends the engine: the adapter alone, over the engine's frozen base, or the "
        "merged weights; auto: the adapter where the engine takes adapters and runs apart from the trainer (a "
        "server), else merged (said at setup, with why).",
    )
    adapters: int = Field(
        1,
        gt=0,
        description="Adapters the engine holds at once, by name (hybridrl tenants: one per tenant, set for you): an "
        "engine that mixes adapters in one call (vllm in-process) loads them side by side.",
    )
    quantize: Literal["none", "4bit", "8bit"] = Field(
        "none",
        description="The frozen base in 4-bit NF4 or 8-bit (bitsandbytes: QLoRA); the adapters train in float32 over "
        "it and every sync sends them alone, to an engine that loads the same quantized base (hf). docs/lora.md.",
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


class TrainerConfig(Strict):
    steps: int = Field(10, gt=0, description="RL steps (rollout + update) to run.")
    prompts_per_step: int = Field(8, gt=0, description="Prompts per step; responses = prompts x rollout.n.")
    mini_batch_size: int | None = Field(
        None, gt=0, description="Responses per optimizer step; default: all responses of the step (one update)."
    )
    micro_batch_size: int | None = Field(
        None,
        gt=0,
        description="Responses per forward/backward (gradient accumulation); default: micro_batch_tokens decides.",
    )
    micro_batch_tokens: int | Literal["auto"] | None = Field(
        "auto",
        description="Without micro_batch_size: a token budget per forward/backward (policy, reference and critic "
        "passes). Each mini-batch's responses, longest first, are cut into as few micro-batches as keep their padded "
        "size (rows x (longest prompt + longest response)) within it (one more only where it saves more padded "
        "tokens than a pass holds), with the least padding; a longer response goes alone (verl's "
        "ppo_max_token_len_per_gpu); with pack_sequences, passes of packed rows instead. Under torchrun, each rank "
        "cuts its own rows, and splits its most padded "
        "passes until it has as many as the rank with the most. 'auto': on a GPU, 80% of the memory free at the "
        "first pass over the activations a token needs (printed at the start); on the CPU, no budget. None: the "
        "whole mini-batch in one pass.",
    )
    share_prompts: bool | Literal["auto"] = Field(
        "auto",
        description="In the policy and reference passes, run each distinct prompt of a pass once and give "
        "its keys and values to every response of it (the n samples of a group) instead of running it once "
        "per response: the same logprobs and gradients from fewer tokens. 'auto': on the CPU (where it "
        "measured 1.26x faster steps), off on a GPU (where the two-part pass measured slower). Off with "
        "activation checkpointing.",
    )
    pack_sequences: bool | Literal["auto"] = Field(
        "auto",
        description="In the policy, reference and critic passes, lay the sequences end to end in rows of the batch's "
        "width rounded up to 128 tokens instead of padding each to the longest, and cut the passes from those rows "
        "(verl's use_remove_padding, OpenRLHF's packing_samples): the same logprobs and gradients from fewer tokens "
        "and fewer shapes to compile where response lengths vary. 'auto': wherever "
        "share_prompts is off (on a GPU by default). Models whose masking does not keep packed sequences apart, "
        "or whose logits are not their output layer's (FSDP, soft-capping), run padded passes.",
    )
    epochs: int = Field(1, gt=0, description="Passes over the step's responses (PPO epochs).")
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay (0: none; negative is refused).")
    warmup_steps: int = Field(
        0,
        ge=0,
        description="Steps over which the learning rate rises linearly to lr: step k trains at k/warmup_steps x lr "
        "(the first at lr/warmup_steps, lr from step warmup_steps on); transformers', TRL's and verl's warm-ups "
        "start at 0 and reach lr one step later.",
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="The learning rate after the warm-up, over the run's steps: constant (verl's default), linear "
        "decay (TRL's and transformers' default) or cosine decay, down to min_lr_ratio x lr at the last step "
        "(transformers' get_linear/cosine_schedule_with_warmup; verl's cosine with min_lr_ratio).",
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Where linear and cosine decay end, as a share of lr.")
    max_grad_norm: float = Field(1.0, gt=0)
    seed: int = 0
    device: str = Field("auto", description="'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1'...")
    threads: int | None = Field(None, gt=0, description="torch CPU threads; default: torch's choice.")
    compile_cache: str | None = Field(
        "auto",
        description="Folder of torch.compile's caches (compiled graphs, Triton kernels, the hf engine's whole "
        "decoding step), kept across runs: a run of a model shape compiled before loads them (keyed by torch, "
        "shapes, dtypes and settings; the step also by the model, transformers and hybridrl's code). "
        "auto: TORCHINDUCTOR_CACHE_DIR where set, else <HYBRIDRL_CACHE or ~/.cache/hybridrl>/torch-compile; "
        "null: torch's default, a folder of /tmp. With it warm for the model, compile: auto compiles shorter runs, "
        "and rollout.compile: auto a run of any length where the decoding step was saved (docs/performance.md).",
    )
    cudnn_attention: bool = Field(
        False,
        description="Let PyTorch's scaled-dot-product attention (transformers' sdpa: the passes, the hf engine's "
        "prompts, reward models) pick cuDNN's kernels on a GPU, as it does by default on Hopper. Off by default: "
        "cuDNN plans each new batch shape at its first pass (0.1-0.5 s for SmolLM2-135M's forward and backward, "
        "H200), and a run's passes meet new row counts as lengths vary (steps up to 4.7x the median); without "
        "it the steady pace was the same at up to 384 tokens (docs/performance.md).",
    )
    run_dir: str | None = Field(
        None, description="Where metrics, samples and checkpoints go; default runs/<config name>-<time>."
    )
    sample_every: int = Field(5, ge=0, description="Save rollout samples every N steps (0: never).")
    save_every: int = Field(
        0, ge=0, description="Checkpoint every N steps (0: only at the end and when interrupted by Ctrl-C or SIGTERM)."
    )
    save_final: bool | Literal["weights"] = Field(
        True,
        description="Checkpoint after the last step: true (everything a resume needs), 'weights' (the policy and "
        "the run's state without the optimizer's, about a third of the size with AdamW: a resume from it starts "
        "the optimizer afresh), or false (none; the policy is then only in the checkpoints of save_every).",
    )
    keep_last: int = Field(2, ge=1, description="Checkpoints to keep; older ones are deleted after a save.")
    resume: bool = Field(
        False,
        description="Continue from the newest checkpoint in run_dir (same as --resume); "
        "starts fresh when there is none.",
    )
    timeout_s: float = Field(
        600,
        gt=0,
        description="Under torchrun: seconds any collective (gradient reduction, weight gathering, metrics) may "
        "wait for the other ranks. A rank that dies or stalls longer makes the others stop with an error naming "
        "the rank and the stage it was last seen in, instead of hanging.",
    )
    eval_every: int = Field(
        0, ge=0, description="Evaluate the data.eval sets after every N steps (0: only before and after training)."
    )
    eval_before_train: bool = Field(
        True, description="Evaluate the data.eval sets before the first step (not when resuming)."
    )
    eval_after_train: bool = Field(True, description="Evaluate the data.eval sets after the last step.")
    on_nonfinite: Literal["abort", "skip"] = Field(
        "abort",
        description="A NaN/Inf in rewards, advantages, "
        "loss or grad norm: abort the run (the last checkpoint stays), "
        "or skip that update and go on.",
    )

    @model_validator(mode="after")
    def _one_layout(self):
        if self.share_prompts is True and self.pack_sequences is True:
            raise ValueError(
                "trainer.share_prompts and trainer.pack_sequences are both true; a pass runs one of them. "
                "Set one to false (or 'auto')."
            )
        return self


def plugin_sections(data: dict, core: list[str]) -> dict[str, Any]:
    """The top-level sections of the run config that plugins registered, each validated against its
    model (its defaults where ``data`` leaves it out, if those validate). A key of ``data`` that is
    neither a core section (``core``) nor a plugin's is an error listing both; so is a plugin's
    section named as a core one."""
    try:
        registered = plugins.config_sections()
    except plugins.PluginError as e:
        raise ConfigError(str(e)) from None
    for name, s in registered.items():
        if name in core:
            raise ConfigError(
                f"Plugin '{s.plugin}' (package '{s.package}') registers the config section '{name}', a section of "
                f"the core ({', '.join(core)}); it needs a name of its own."
            )
    for key in data:
        if key not in core and key not in registered:
            theirs = ", ".join(f"{n} (plugin '{s.plugin}')" for n, s in sorted(registered.items())) or "none installed"
            raise ConfigError(
                f"Unknown key '{key}' in the top level.{did_you_mean(key, [*core, *registered])} Valid keys: "
                f"{', '.join(core)}; and the plugins' sections: {theirs}. Run 'hybridrl plugins' to see them."
            )
    out = {}
    for name, s in registered.items():
        try:
            out[name] = s.cls.model_validate(data.get(name) or {})
        except ValidationError as e:
            if name in data:  # else required keys, and no such section in the YAML: cfg.section says so
                raise ConfigError(options_error(e, name, f"plugin '{s.plugin}'", [], keys_of(s.cls))) from None
    return out
