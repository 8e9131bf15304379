"""The run config: one YAML file, validated by pydantic, with dotted command-line overrides.

Each component section names a plugin (``rollout: {engine: vllm, ...}``). Keys the core
defines for every plugin of that kind (``n``, ``temperature``...) and keys of the chosen
plugin's own ``Options`` model live side by side in the section; any other key is an error
that lists the valid ones. A plugin may own a top-level section of its own
(``register_config_sections``: ``online`` is hybridrl-serve's), read as ``cfg.section(name)``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, ValidationError, model_validator

from hybridrl import plugins
from hybridrl.components import INPUT_PATH, Sampling
from hybridrl.config_files import (
    apply_overrides,
    beside_config,
    format_validation_error,
    interpolate_env,
    keys_of,
    load_yaml,
    options_error,
)
from hybridrl.config_sections import (  # noqa: F401 (TrainerConfig: importable from here as before)
    AgentConfig,
    EvalSet,
    LoraOptions,
    Section,
    Strict,
    TrainerConfig,
    plugin_sections,
)
from hybridrl.errors import ConfigError, did_you_mean
from hybridrl.shaping import ShapingOptions


class ModelConfig(Strict):
    path: str = Field(
        description="A Hugging Face model folder, or a folder holding a GGUF file "
        "(with gguf_file), or 'package:NAME' for a folder inside an installed package.",
        json_schema_extra=INPUT_PATH,
    )
    gguf_file: str | None = Field(
        None, description="GGUF file name inside path; converted once to a plain HF folder in the cache."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Dtype the model is loaded and computed in. The frozen copies (reference, rollout engine) "
        "keep it; a trained model (the policy, a critic) keeps float32 master weights and computes in it under "
        "autocast, since an optimizer step far below a bfloat16 ulp would change no weight.",
    )
    trust_remote_code: bool = False
    attn_implementation: str | None = Field(
        None,
        description="transformers' attention for the trained models and the reference (from_pretrained's "
        "attn_implementation): sdpa, eager, flex_attention, flash_attention_2 (needs the flash-attn package), "
        "or a kernels hub id; default: transformers' choice (sdpa). The hf engine's decoding keeps its own.",
    )
    lora: LoraOptions | None = Field(
        None,
        description="Train LoRA adapters instead of every weight (peft): {r, alpha, dropout, target_modules, path, "
        "sync}. The reference policy is the base model with the adapters off; engines receive the adapter alone or "
        "merged weights (model.lora.sync).",
    )
    dropout: bool = Field(
        False,
        description="Keep the model's dropout active while training. Off by default (TRL's disable_dropout): "
        "with dropout, the update's logprobs differ from those the responses were sampled with even before "
        "the first optimizer step, and the importance ratios are noise.",
    )


class DataConfig(Section):
    source: str | None = Field(
        "hf", description="Prompt source plugin; null: none (prompts come from elsewhere: hybridrl tinker)."
    )
    prompt_column: str = Field(
        "auto",
        description="Row field holding the prompt: text (through data.template) or a list of chat messages; a dotted "
        "path reaches a nested field. auto: 'prompt' (TRL's and verl's column) where the rows have it, else "
        "'question'.",
    )
    answer_column: str | None = Field(
        "auto",
        description="Row field with the ground truth given to rewards (batch['answer']); a dotted path reaches a "
        "nested field. auto: 'answer' where the rows have it, else verl's 'reward_model.ground_truth', else none. "
        "Every field of the row reaches rewards anyway (batch['row']).",
    )
    template: str = Field(
        "{prompt}",
        description="Python format string for the user message; {prompt} is "
        "the prompt column, other row fields are available by name.",
    )
    system_prompt: str | None = Field(None, description="System message put before the user message.")
    chat_template: bool = Field(True, description="Apply the tokenizer's chat template.")
    max_prompt_tokens: int = Field(512, gt=0, description="Longer prompts are an error.")
    shuffle: bool = True
    eval: list[EvalSetConfig] = Field(
        default_factory=list,
        description="Held-out sets evaluated before training, every trainer.eval_every steps and after the last "
        "(docs/evaluation.md): each a name, a prompt source and its options, like this section.",
    )


class RolloutConfig(Section, Sampling):
    """The rollout section: the engine plugin, the sampling keys (:class:`Sampling`), refill rounds."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    engine: str = Field("hf", description="Rollout engine plugin.")
    agent: AgentConfig | None = Field(
        None, description="Multi-turn rollouts with an environment and tools (docs/agents.md); unset: one turn."
    )
    async_: int = Field(
        0,
        ge=0,
        alias="async",
        description="Generate up to this many steps ahead while the policy trains, with weights at most that many "
        "updates old (needs an engine apart from training: a server, rollout.base_url); each response records "
        "the policy_version that sampled it, and the algorithm's rollout_correction covers the staleness. 0: off.",
    )
    stream: bool = Field(
        False,
        description="With rollout.async k and an engine that takes syncs in flight: each prompt's group is an engine "
        "call of its own, (k + 1) x prompts_per_step groups are always started and not yet trained, and a step "
        "trains the first groups to finish, after those the next step could not train (a token older than the weights "
        "of k steps back), which it waits for: nothing generated is dropped but past that bound "
        "(rollout/stale_groups). docs/async.md.",
    )
    step_tokens: int | None = Field(
        None,
        gt=0,
        description="With rollout.stream: a step trains the first groups to finish until their responses hold at "
        "least this many tokens (whole groups, one at least), so a step's size is its tokens whatever their "
        "lengths; trainer.prompts_per_step then sizes what stays in flight. null: prompts_per_step groups a step.",
    )
    sync_check: float = Field(
        0.3,
        ge=0,
        description="Before the first update the engine, holding the policy's own weights, samples one token of a "
        "probe prompt and its logprobs are compared with the policy's: a mean |difference| above this stops the run "
        "as a logprob convention error of the engine (temperature, offset, precision), after step 1's metrics are "
        "written. After a weight sync (see sync_check_every) the same probe may differ by max(this, 20 x that first "
        "difference): above it the run stops, naming the rank (an engine that did not take the weights). 0: off. "
        "Engines in float32 differ by about 1e-5, in bfloat16 by about 1e-2.",
    )
    sync_check_every: int = Field(
        10,
        ge=0,
        description="Run sync_check after the first weight sync of a run (and of each resume), then every this "
        "many steps; 0: the first sync only, 1: every sync. It costs a short generation and a forward pass "
        "(about 7% of a 0.7 s step on one GPU). Every step logs rollout/logprob_diff_mean, the same "
        "difference over all of the step's responses.",
    )
    refill_rounds: int = Field(
        0,
        ge=0,
        description="When the algorithm's filter drops groups (GRPO's dynamic_sampling), draw and generate up to "
        "this many more rounds of prompts_per_step prompts until prompts_per_step groups are kept, and train on "
        "that many (verl's DAPO recipe: max_num_gen_batches). 0: train on what is left.",
    )


class RewardConfig(Section):
    function: str = Field(description="Reward function plugin.")
    weight: float = 1.0
    name: str | None = Field(None, description="Name in logs; defaults to the function name.")
    shaping: ShapingOptions = Field(
        default_factory=ShapingOptions,
        description="Score shaping before the weighted sum: normalize, length_penalty, clip (docs/rewards.md).",
    )

    @property
    def label(self) -> str:
        return self.name or self.function


class EvalSetConfig(EvalSet):
    """A held-out set of ``data.eval``: :class:`~hybridrl.config_sections.EvalSet` and its rewards."""

    rewards: list[RewardConfig] | None = Field(
        None, description="The set's rewards; default: the run's (the same functions, their scores not shaped)."
    )

    def check(self, where: str) -> None:
        super().check(where)
        labels = [r.label for r in self.rewards or []]
        if len(set(labels)) != len(labels):
            raise ConfigError(
                f"{where}.rewards (set '{self.name}'): two rewards share a name ({', '.join(labels)}); "
                "set 'name' on each."
            )


DataConfig.model_rebuild()  # data.eval's sets, defined after the data section (they hold rewards)


class AlgorithmConfig(Section):
    name: str = Field("grpo", description="Algorithm plugin.")


class ShardingConfig(Section):
    strategy: str = Field("single", description="Sharding strategy plugin.")


class LoggingConfig(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    loggers: list[str] = Field(
        default_factory=lambda: ["console", "jsonl"],
        description="Logger plugins; each one's options go under logging.<name>.",
    )
    _options: dict[str, Any] = PrivateAttr(default_factory=dict)


class RunConfig(Strict):
    model: ModelConfig
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    rewards: list[RewardConfig] = Field(
        default_factory=list, description="The reward functions; every run with data needs one (docs/rewards.md)."
    )
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    sharding: ShardingConfig = Field(default_factory=ShardingConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    _env_refs: dict = PrivateAttr(default_factory=dict)  # {path: the text with ${env:VAR}}, for dump_config
    _sections: dict = PrivateAttr(default_factory=dict)  # the plugins' top-level sections, validated

    def section(self, name: str):
        """The validated options of the top-level section ``name`` that a plugin registered
        (``register_config_sections``): the YAML's, or the defaults where it leaves the section out."""
        if name not in self._sections:
            raise ConfigError(f"The config has no section '{name}' (plugins' sections: {sorted(self._sections)}).")
        return self._sections[name]

    def complete(self) -> dict:
        """The config as a mapping with every default written out, the plugins' options included:
        what a run writes to its config.yaml (:func:`hybridrl.config_files.dump_config`)."""
        data = self.model_dump(mode="json", by_alias=True)
        for _, where, section, _ in component_sections(self):
            node = data
            for part in re.findall(r"[^.\[\]]+", where):
                node = node[int(part)] if part.isdigit() else node[part]
            if section.options is not None:
                node.update(section.options.model_dump(mode="json", by_alias=True))
        for name, options in self.logging._options.items():
            data["logging"][name] = options.model_dump(mode="json", by_alias=True)
        if self.rollout.agent is not None:
            tools = self.rollout.agent._tool_options
            data["rollout"]["agent"]["tool_options"] = {n: o.model_dump(mode="json") for n, o in tools.items()}
        return data | {n: o.model_dump(mode="json", by_alias=True) for n, o in self._sections.items()}

    @model_validator(mode="after")
    def _batch_sizes_divide(self):
        t = self.trainer
        total = t.prompts_per_step * self.rollout.n
        mini = t.mini_batch_size or total
        if total % mini:
            raise ValueError(
                f"trainer.mini_batch_size={mini} does not divide the {total} responses of a step "
                f"(trainer.prompts_per_step={t.prompts_per_step} x rollout.n={self.rollout.n}); "
                f"use a divisor of {total}."
            )
        if t.micro_batch_tokens is not None and t.micro_batch_tokens != "auto" and t.micro_batch_tokens <= 0:
            raise ValueError(
                f"trainer.micro_batch_tokens={t.micro_batch_tokens}: a positive number of tokens, or auto."
            )
        if t.micro_batch_size and t.micro_batch_tokens not in (None, "auto"):
            raise ValueError(
                "trainer.micro_batch_size and trainer.micro_batch_tokens both set; "
                "choose one (a fixed number of responses, or a token budget)."
            )
        micro = t.micro_batch_size or mini
        if mini % micro:
            raise ValueError(
                f"trainer.micro_batch_size={micro} does not divide trainer.mini_batch_size={mini}; "
                f"use a divisor of {mini}."
            )
        return self


# -- loading ------------------------------------------------------------------------------


def load_config(path: str | Path | None = None, overrides: list[str] = (), data: dict | None = None) -> RunConfig:
    """Read YAML (or take ``data``), apply ``key.sub=value`` overrides, put in the environment variables
    that ``${env:VAR}`` names (:func:`interpolate_env`), validate everything. A file or folder the
    run reads (fields marked :data:`~hybridrl.components.INPUT_PATH`: model.path, a dataset's
    files, a reward's code) given as a relative path is looked up beside the config file first,
    then in the current directory (:func:`beside_config`)."""
    if data is None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"Config file not found: {path}")
        data = load_yaml(path.read_text(), str(path)) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path} must hold a mapping of sections (model, rollout, ...).")
    data = apply_overrides(data, overrides)
    refs: dict[tuple, str] = {}
    data = interpolate_env(data, (), refs)
    sections = plugin_sections(data, keys_of(RunConfig))
    try:
        cfg = RunConfig.model_validate({k: v for k, v in data.items() if k not in sections})
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, RunConfig)) from None
    cfg._sections = sections
    resolve(cfg)
    cfg._env_refs = refs
    if path is not None:
        for model in [cfg, *sections.values()]:
            beside_config(model, Path(path).resolve().parent)
    return cfg


def resolve(cfg: RunConfig) -> None:
    """Look up every named plugin and validate its options; errors list the choices."""
    for kind, where, section, name in component_sections(cfg):
        cls = _lookup(kind, name)
        section._options = _validate_options(cls, section.model_extra or {}, where, kind, name, type(section))
    labels = [r.label for r in cfg.rewards]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"rewards: two rewards share a name ({', '.join(labels)}); set 'name' on each.")
    names = [s.name for s in cfg.data.eval]
    if len(set(names)) != len(names):
        raise ConfigError(f"data.eval: two sets share a name ({', '.join(names)}); give each its own.")
    for i, s in enumerate(cfg.data.eval):
        s.check(f"data.eval[{i}]")
    agent = cfg.rollout.agent
    if agent is not None:
        unknown = sorted(set(agent.tool_options) - set(agent.tools))
        if unknown:
            raise ConfigError(
                f"rollout.agent.tool_options has options for {', '.join(unknown)}, which rollout.agent.tools does "
                f"not list ({', '.join(agent.tools) or 'none'})."
            )
        for name in agent.tools:
            cls = _lookup("tool", name)
            where = f"rollout.agent.tool_options.{name}"
            agent._tool_options[name] = _validate_options(
                cls, agent.tool_options.get(name, {}), where, "tool", name, None
            )
        cls = _lookup("tool parser", agent.parser)
        agent._parser_options = _validate_options(cls, {}, "rollout.agent", "tool parser", agent.parser, None)
    if "jsonl" not in cfg.logging.loggers:  # the run's record: the dashboard and resume read it
        cfg.logging.loggers.append("jsonl")
    extra = dict(cfg.logging.model_extra or {})
    for name in cfg.logging.loggers:
        cls = _lookup("logger", name)
        sub = extra.pop(name, None) or {}
        cfg.logging._options[name] = _validate_options(cls, sub, f"logging.{name}", "logger", name, None)
    if extra:
        key = next(iter(extra))
        raise ConfigError(
            f"Unknown key '{key}' in logging.{did_you_mean(key, ['loggers', *cfg.logging.loggers])} Valid keys: "
            "loggers, and one section per logger in "
            f"logging.loggers ({', '.join(cfg.logging.loggers)})."
        )


def component_sections(cfg: RunConfig):
    """``(kind, where, section, plugin name)`` of each component section of the config, from the
    table of kinds (``plugins.KINDS``): rollout, algorithm, sharding, data, and each reward."""
    for kind, k in plugins.KINDS.items():
        if not k.own_section:  # loggers' and tools' options are mappings of their own
            continue
        section = cfg
        for part in k.section.split("."):
            section = getattr(section, part) if section is not None else None
        if section is None:  # an optional section left out (rollout.agent)
            continue
        if k.many:
            for i, item in enumerate(section):
                yield kind, f"{k.section}[{i}]", item, getattr(item, k.key)
        elif getattr(section, k.key) is not None:  # data.source: null (a run without data)
            yield kind, k.section, section, getattr(section, k.key)
    for i, s in enumerate(cfg.data.eval):  # held-out sets: a prompt source each, and maybe rewards of their own
        yield "dataset", f"data.eval[{i}]", s, s.source
        for j, r in enumerate(s.rewards or []):
            yield "reward function", f"data.eval[{i}].rewards[{j}]", r, r.function


def _lookup(kind: str, name: str) -> type:
    try:
        return plugins.lookup(kind, name)
    except plugins.PluginError as e:
        raise ConfigError(str(e)) from None


def _validate_options(cls, values: dict, where: str, kind: str, name: str, section_cls) -> Any:
    try:
        options = cls.Options.model_validate(values)
        values.update({k: v for k, v in options if isinstance(v, SecretStr) and k in values})  # no repr shows it
        return options
    except ValidationError as e:
        core_keys = keys_of(section_cls) if section_cls else []
        raise ConfigError(options_error(e, where, f"{kind} '{name}'", core_keys, keys_of(cls.Options))) from None
