"""Every check of a run that needs no model, in one place: ``hybridrl validate`` and ``hybridrl
import`` run it on a config, and a run (``hybridrl train``, ``eval``, ``serve``) runs it before any
model loads (:func:`hybridrl.run.build_run`). It reads what a run reads first (the model
folder's config and tokenizer, the prompt sources' rows) and hands it over (:class:`Checked`), so
that the run builds on what was checked.

In order, each failure one error that names the key and the fix:

- model.path (with model.gguf_file), and every model folder a component's options name (fields
  marked :data:`~hybridrl.options.MODEL_PATH`, e.g. PPO's critic_path);
- for a training run, model.attn_implementation (a name transformers knows, its package installed, a
  GPU where it needs one) and checkpoints already in trainer.run_dir without trainer.resume;
- the model folder's config and tokenizer;
- for a training run, the training rows: there are some, with the prompt and answer columns and
  the fields every reward reads (:meth:`~hybridrl.components.RewardFunction.needs`); the prompts
  built (template, system prompt, chat template) within data.max_prompt_tokens and, with
  rollout.max_tokens, the model's context;
- the same for each data.eval set (:class:`hybridrl.evaluation.Evaluation`);
- for a training run, the rollout engine in this launch beside the policy
  (:meth:`~hybridrl.components.RolloutEngine.check_launch`).

:func:`check_world` (the sharding strategy against torchrun's ranks) runs earlier, before the
process group is joined (:func:`hybridrl.run.join_processes`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import torch

from hybridrl import checkpoint as ckpt
from hybridrl import distributed, plugins
from hybridrl.components import RunContext, Sampling, TrainingMemory
from hybridrl.config import RunConfig, component_sections
from hybridrl.devices import resolve_device
from hybridrl.errors import ConfigError, StageError, did_you_mean
from hybridrl.evaluation import Evaluation
from hybridrl.models import (
    DTYPES,
    check_context,
    check_model_path,
    load_model_config,
    load_tokenizer,
    parameter_count,
    resolve_model_path,
)
from hybridrl.prompts import check_columns, check_reward_fields, longest_prompt

#: what :func:`check` raises for a config that cannot run here (anything else is a bug)
FAILURES = (ConfigError, plugins.PluginError, FileNotFoundError, ImportError, StageError)
#: flash attention's implementations: the module transformers imports, and the package that installs it
FLASH_ATTENTION = {
    "flash_attention_2": ("flash_attn", "flash-attn"),
    "flash_attention_3": ("flash_attn_interface", "flash-attn-3"),
    "flash_attention_4": ("flash_attn", "flash-attn-4"),
}


@dataclasses.dataclass
class Checked:
    """What :func:`check` read, for the run to build on."""

    model_path: str  # the plain Hugging Face folder of model.path (a GGUF file converted)
    tokenizer: Any
    model_config: Any  # the policy's transformers config
    ctx: RunContext  # the run's context: the strategy and the pass runner join it once built
    data: Any  # the training prompt source; None for evaluation alone
    evaluation: Evaluation  # the data.eval sets, built and checked


def check(cfg: RunConfig, device: torch.device | None = None, run_dir=None, *, train=True, data=True, calls=None):
    """Run every check of ``cfg`` that needs no model on ``device`` (default: trainer.device's);
    ``run_dir``: the run's folder (default: trainer.run_dir, where set). ``train``: for a training run;
    False for evaluation alone (``hybridrl eval``: no training data, no trained model). ``data``: False
    for a training run whose prompts come from elsewhere (prompts of up to data.max_prompt_tokens;
    ``calls`` responses an engine call at the most, None: any number)."""
    device = device if device is not None else run_device(cfg)
    run_dir = run_dir if run_dir is not None else Path(cfg.trainer.run_dir) if cfg.trainer.run_dir else None
    check_sources(cfg, train, data)
    check_model_path(cfg.model.path, cfg.model.gguf_file)
    check_component_models(cfg)
    if train:
        check_attention(cfg.model.attn_implementation, device)
        if run_dir is not None and not cfg.trainer.resume and ckpt.list_checkpoints(run_dir):
            raise ConfigError(
                f"{run_dir} already holds checkpoints. Continue that run with --resume "
                "(trainer.resume=true), or choose a new trainer.run_dir."
            )
    with distributed.main_first():  # one rank converts a GGUF file into the shared cache
        model_path = resolve_model_path(cfg.model.path, cfg.model.gguf_file)
    model_config = load_model_config(model_path, cfg.model.trust_remote_code)
    try:
        tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        reason = " ".join(str(e).split()) or type(e).__name__
        raise ConfigError(
            f"model.path {cfg.model.path}: transformers cannot load its tokenizer ({type(e).__name__}: {reason}). "
            "A model folder needs its tokenizer files (tokenizer.json or the model family's, tokenizer_config.json)."
        ) from None
    ctx = run_context(cfg, model_path, tokenizer, device, run_dir or Path("runs"), data, calls)
    if train and cfg.model.lora:
        ctx.join(lora=cfg.model.lora)
    source = None
    if train and not data:
        ctx.join(prompt_tokens=cfg.data.max_prompt_tokens)
    elif train:
        source = plugins.build("dataset", cfg.data.source, cfg.data.options, ctx)
        check_columns(source, cfg)
        longest = longest_prompt(source, cfg.data, tokenizer)
        check_context(model_config, longest, cfg.rollout.max_tokens)
        check_reward_fields(source[0], cfg.data, cfg.rewards, "data", "data")
        ctx.join(prompt_tokens=longest)
    evaluation = Evaluation(
        cfg, lambda kind, name, options: plugins.build(kind, name, options, ctx), tokenizer, model_config
    )
    if not train and not evaluation.sets:
        raise ConfigError("data.eval holds no sets to evaluate; add one (docs/evaluation.md).")
    if train and device.type == "cuda":  # what an engine sharing the GPU must leave to training
        lora = cfg.model.lora
        parameters, adapters = parameter_count(model_config, cfg.model.trust_remote_code, lora)
        frozen = {"none": 4, "8bit": 1.5, "4bit": 1}[lora.quantize] if lora else 4  # float32, or bits and scales
        ctx.join(training_memory=TrainingMemory.of(parameters, ctx.world_size, adapters, frozen))
    if train:  # beside the policy; the engine is built after it (it takes a share of what memory is left)
        try:
            plugins.lookup("rollout engine", cfg.rollout.engine).check_launch(cfg.rollout.options, ctx)
        except ValueError as e:
            raise ConfigError(f"rollout engine '{cfg.rollout.engine}': {e}") from None
    return Checked(model_path, tokenizer, model_config, ctx, source, evaluation)


def check_sources(cfg: RunConfig, train: bool, data: bool) -> None:
    """A run with data has prompts to read and rewards to score them (a run without: its face brings both)."""
    if data and train and cfg.data.source is None:
        raise ConfigError("data.source is null: a training run needs its prompts (data.source: hf, with data.path)")
    if data and not cfg.rewards:
        raise ConfigError("rewards: the run scores its responses with at least one: rewards: [{function: NAME}]")


def run_device(cfg: RunConfig) -> torch.device:
    """This process's device for the policy (trainer.device; under torchrun, the rank's GPU)."""
    try:
        return resolve_device(cfg.trainer.device, per_rank=True)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def run_context(
    cfg: RunConfig, model_path: str, tokenizer, device: torch.device, run_dir: Path, data: bool = True, calls=None
) -> RunContext:
    """What the components learn of the run; the strategy and the passes join it once built."""
    t = cfg.trainer
    return RunContext(
        model_path=model_path,
        tokenizer=tokenizer,
        device=device,
        dtype=DTYPES[cfg.model.dtype],
        seed=t.seed,
        run_dir=run_dir,
        rank=distributed.rank(),
        world_size=distributed.world_size(),
        local_rank=distributed.env_world()[2],
        trust_remote_code=cfg.model.trust_remote_code,
        dropout=cfg.model.dropout,
        response_tokens=cfg.rollout.max_tokens,
        steps=t.steps,
        sampling=Sampling(**cfg.rollout.model_dump(include=set(Sampling.model_fields))),
        # a run without a dataset answers its face's requests: of the size it says, or any
        responses_per_call=t.prompts_per_step // distributed.world_size() * cfg.rollout.n if data else calls,
    )


def check_component_models(cfg: RunConfig) -> None:
    """Each model folder a component's options name (a field marked :data:`~hybridrl.options.MODEL_PATH`)
    is there, as model.path is checked; such fields take Hugging Face folders, no GGUF file."""
    for _, where, section, _ in component_sections(cfg):
        options = section.options
        for name, field in type(options).model_fields.items() if options is not None else ():
            path = getattr(options, name)
            if (field.json_schema_extra or {}).get("model_path") and path is not None:
                check_model_path(path, None, f"{where}.{field.alias or name}", gguf_key=None)


def check_attention(name: str | None, device: torch.device) -> None:
    """model.attn_implementation can load on ``device``: a name transformers knows (or a kernels hub
    id, org/name, which transformers fetches itself), and flash attention's package and a GPU."""
    if name is None or "/" in name:
        return
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        known = sorted({"eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()})
    except (ImportError, AttributeError):  # another transformers: its own error at load
        known = [name]
    if name.removeprefix("paged|") not in known and name not in known:
        raise ConfigError(
            f"model.attn_implementation '{name}' cannot be used: transformers has no such attention."
            f"{did_you_mean(name, known)} Known: {', '.join(known)}, or a kernels hub id (org/name). Leave it "
            "unset (transformers' sdpa; eager for a model whose attention soft-caps, as Gemma-2's)."
        )
    if name not in FLASH_ATTENTION:
        return
    module, package = FLASH_ATTENTION[name]
    reasons = [f"{package} is not installed"] if importlib.util.find_spec(module) is None else []
    if device.type == "cpu":
        reasons.append(f"it runs on CUDA GPUs only, and this run's device is {device} (trainer.device)")
    if reasons:
        raise ConfigError(
            f"model.attn_implementation '{name}' cannot be used here: {'; '.join(reasons)}. Install {package} on "
            f"a CUDA machine (pip install {package} --no-build-isolation), or leave model.attn_implementation "
            "unset (transformers' sdpa; eager for a model whose attention soft-caps, as Gemma-2's)."
        )


def check_world(cfg: RunConfig, world: int, multi_process: bool) -> None:
    """The config can run on ``world`` processes (torchrun's WORLD_SIZE) with its sharding strategy."""
    t, strategy = cfg.trainer, cfg.sharding.strategy
    if world == 1:
        return
    if not multi_process:
        raise ConfigError(
            f"sharding.strategy '{strategy}' trains on one process, but torchrun started {world} "
            f"(WORLD_SIZE={world}): their models would drift apart. Set sharding.strategy=fsdp, or run without "
            "torchrun."
        )
    if t.prompts_per_step % world:
        raise ConfigError(
            f"trainer.prompts_per_step={t.prompts_per_step} does not divide by the {world} ranks of this run "
            f"(torchrun --nproc-per-node x nodes): each rank takes whole prompts with all their samples. "
            f"Use a multiple of {world}."
        )
    if t.mini_batch_size and t.mini_batch_size % world:
        raise ConfigError(
            f"trainer.mini_batch_size={t.mini_batch_size} does not divide by the {world} ranks of this run; "
            f"each rank trains on mini_batch_size / {world} responses per optimizer step. Use a multiple of {world}."
        )
