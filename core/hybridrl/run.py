"""A run: every part a command works with, built once from the config by :func:`build_run`.

``hybridrl train`` hands the :class:`Run` to the loop (:class:`hybridrl.trainer.Trainer`);
``hybridrl eval`` builds one without training parts (``train=False``) and evaluates with it; faces
in plugins (serve, the importer's checks, benchmarks) build theirs the same way. The order: the
process (seed, threads, the torchrun group), every check that needs no model
(:func:`hybridrl.preflight.check`), the sharding strategy and the pass runner, the algorithm and the
rewards, the models, the engine and its session, the agent loop, the evaluation sets' connection,
the loggers. Bad input fails before any model loads; a failure later releases what was built.

The run's :class:`~hybridrl.components.RunContext` is built once, before any component, and every
component gets that one object: what the run learns while it builds joins it in place
(:meth:`~hybridrl.components.RunContext.join`: the longest prompt after the prompt sources, the
strategy and the pass runner once built).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from hybridrl import checkpoint as ckpt
from hybridrl import distributed, lora, plugins, preflight, rope
from hybridrl.agents import build_agent
from hybridrl.compile import use_cache
from hybridrl.components import RunContext
from hybridrl.config import RunConfig
from hybridrl.config_files import write_config
from hybridrl.errors import ConfigError
from hybridrl.memory import MicroBatches
from hybridrl.models import check_quantized_base, disable_dropout, end_token_ids, load_causal_lm
from hybridrl.passes import Planner, Runner
from hybridrl.prompts import PromptOrder
from hybridrl.rewards import Rewards
from hybridrl.rollout import RolloutStage
from hybridrl.session import EngineSession


@dataclass(frozen=True)
class Run:
    """The parts of one run, read-only (a part's own state changes; which parts a run has does not).

    Training parts are None in a run built with ``train=False`` (``hybridrl eval``): ``data``,
    ``prompts``, ``strategy``, ``passes``, ``algorithm``, ``policy``, ``optimizer``, ``scheduler``,
    ``rollout``; ``ref`` is None without a reference model (LoRA: the policy with its adapters off).
    A run built with ``data=False`` trains on what its face brings (the Tinker server): it has the
    policy, the optimizer and the engine, and no ``data``, ``prompts`` or ``rollout``.
    """

    config: RunConfig
    run_dir: Path
    ctx: RunContext  # the one context every component got
    tokenizer: Any
    model_config: Any  # the policy's transformers config
    rewards: Rewards
    engine: Any  # the rollout engine (hybridrl.components.RolloutEngine); calls go through ``session``
    session: EngineSession
    agent: Any  # the agent loop of rollout.agent, or None
    evaluation: Any  # hybridrl.evaluation.Evaluation: the data.eval sets, connected
    loggers: list  # rank 0's loggers (none on other ranks), opened by the loop
    data: Any = None
    prompts: PromptOrder | None = None
    strategy: Any = None
    passes: Runner | None = None
    algorithm: Any = None
    policy: torch.nn.Module | None = None
    ref: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    rollout: RolloutStage | None = None

    def build(self, kind: str, name: str, options) -> Any:
        """A component of ``kind`` named ``name`` with ``options``, built with the run's context."""
        return plugins.build(kind, name, options, self.ctx)

    def close(self, together: bool = False) -> None:
        """Release the rewards, the evaluation sets and the engine, and leave the process group
        (``together``: every rank ended normally and leaves at once)."""
        self.rewards.close()
        self.evaluation.close()
        if self.agent is not None:
            self.agent.close()
        self.session.close()
        distributed.teardown(together=together)


def build_run(
    config: RunConfig, name: str = "run", *, train: bool = True, data: bool = True, calls: int | None = None
) -> Run:
    """The run of ``config``: its folder is trainer.run_dir, or ``runs/NAME-TIMESTAMP``. ``train``:
    with the policy, its optimizer and the training data; False for evaluation alone (the engine
    loads model.path; no training data; any number of torchrun ranks). ``data``: False for a
    training run without the config's data (its prompts come from elsewhere); ``calls``: then the
    most responses one engine call asks for, where its face knows (None: any number)."""
    t = config.trainer
    if t.resume and not t.run_dir:
        raise ConfigError("trainer.resume (--resume) needs trainer.run_dir: the directory of the run to continue.")
    ckpt.seed_everything(t.seed)
    if t.threads:
        torch.set_num_threads(t.threads)
    use_cache(t.compile_cache)  # before anything compiles
    torch.backends.cuda.enable_cudnn_sdp(t.cudnn_attention)  # the process's; no-op without CUDA
    device = join_processes(config, train)
    run_dir = Path(t.run_dir or f"runs/{name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    run_dir = Path(distributed.broadcast_object(str(run_dir)))  # rank 0's
    built: list = []  # what needs releasing if a later part fails
    try:
        return _build(config, device, run_dir, train, built, data, calls)
    except BaseException:
        for part in reversed(built):
            with contextlib.suppress(Exception):
                part.close()
        distributed.teardown()
        raise


def _build(config: RunConfig, device: torch.device, run_dir: Path, train: bool, built: list, data: bool, calls) -> Run:
    checked = preflight.check(config, device, run_dir, train=train, data=data, calls=calls)  # needing no model
    ctx, tokenizer = checked.ctx, checked.tokenizer
    evaluation = checked.evaluation
    built.append(evaluation)
    # the owner's alone (configs, logs, samples, checkpoints), one made beforehand too; by every rank at once
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    if run_dir.stat().st_uid == os.getuid() and run_dir.stat().st_mode & 0o077:
        run_dir.chmod(0o700)
    if train and ctx.is_main:
        write_config(run_dir / "config.yaml", config)
    build = functools.partial(plugins.build, ctx=ctx)
    parts = training_parts(config, checked, build) if train else {}
    rewards = Rewards([(r, build("reward function", r.function, r.options)) for r in config.rewards], device)
    built.append(rewards)
    if train:
        parts |= models(config, checked.model_path, ctx, parts["strategy"], parts["algorithm"])
    engine = build("rollout engine", config.rollout.engine, config.rollout.options)
    t = config.trainer
    session = EngineSession(engine, config.rollout, t.seed, t.prompts_per_step, tokenizer.pad_token_id)
    built.append(session)
    if train:
        follow_engine_positions(engine, parts, checked.model_config, config, ctx.is_main)
    if train and config.model.lora:
        options = config.model.lora
        if options.quantize != "none":  # the adapter alone, wherever the engine generates
            check_quantized_base(options, engine, config.rollout.engine, config.sharding.strategy)
            options = options.model_copy(update={"sync": "adapter"})
        session.adapters, said = lora.choose_sync(options, engine, parts["policy"], config.rollout.engine)
        if ctx.is_main:
            print(said, flush=True)
        if session.adapters:  # the adapter as it starts (lora_B zero: the base), so that one the engine cannot serve
            adapter = lora.adapter(parts["strategy"], parts["policy"], 0)  # stops the run here, not at a sync
            session.sync(lambda: adapter, update=False)
    agent = build_agent(build, config, session, tokenizer, end_token_ids(checked.model_path, tokenizer))
    if train and data:
        parts["rollout"] = RolloutStage(session, parts["data"], parts["prompts"], tokenizer, config, agent)
    evaluation.connect(session, rewards, agent, build)
    names = config.logging.loggers if train and ctx.is_main else []  # rank 0 writes the run's record
    loggers = [build("logger", n, config.logging._options[n]) for n in names]
    return Run(
        config, run_dir, ctx, tokenizer, checked.model_config, rewards, engine, session, agent, evaluation, loggers,
        **parts,
    )  # fmt: skip


def join_processes(config: RunConfig, train: bool) -> torch.device:
    """This process's device; under torchrun, check the config for N ranks (a training run) and
    join the process group."""
    device = preflight.run_device(config)
    if train:
        try:
            multi_process = plugins.lookup("sharding strategy", config.sharding.strategy).multi_process
        except plugins.PluginError as e:
            raise ConfigError(str(e)) from None
        preflight.check_world(config, distributed.env_world()[1], multi_process)
    distributed.setup(device, timeout_s=config.trainer.timeout_s)
    return device


def training_parts(config: RunConfig, checked: preflight.Checked, build) -> dict:
    """The training data's order, the sharding strategy, the pass runner and the algorithm; the
    strategy and the pass runner join the run's context as they are built."""
    t, ctx = config.trainer, checked.ctx
    strategy = build("sharding strategy", config.sharding.strategy, config.sharding.options)
    ctx.join(strategy=strategy)
    budget = MicroBatches(t.micro_batch_size, t.micro_batch_tokens, checked.model_config, strategy, ctx.device)
    planner = Planner(t.share_prompts, t.pack_sequences, budget, ctx.device, strategy.pack_width)
    passes = Runner(planner, strategy, ctx.device)
    ctx.join(passes=passes)
    return {
        "data": checked.data,
        "prompts": PromptOrder(len(checked.data), t.seed, config.data.shuffle) if checked.data is not None else None,
        "strategy": strategy,
        "passes": passes,
        "algorithm": build("algorithm", config.algorithm.name, config.algorithm.options),
    }


def models(config: RunConfig, model_path: str, ctx: RunContext, strategy, algorithm) -> dict:
    """The policy (with its LoRA adapters), the reference when the algorithm needs one, the
    optimizer and its schedule, placed by the sharding strategy."""
    m, t = config.model, config.trainer

    quantize = m.lora.quantize if m.lora else "none"  # a quantized base loads on its device, where it computes
    if quantize != "none":
        check_quantized_base(m.lora, None, config.rollout.engine, config.sharding.strategy)

    def load(adapters=None):
        device = ctx.device if quantize != "none" else torch.device("cpu")
        model = load_causal_lm(model_path, ctx.dtype, device, m.trust_remote_code, m.attn_implementation, quantize)
        model = lora.apply_lora(model, adapters) if adapters else model
        return model if m.dropout else disable_dropout(model)

    policy = strategy.wrap(load(m.lora).train(), trainable=True)
    ref = None  # with LoRA the reference is the policy with its adapters off
    if algorithm.needs_reference and not m.lora:
        ref = strategy.wrap_reference(load().eval().requires_grad_(False))
    if m.lora and ctx.is_main:
        print(lora.describe(policy, m.lora, algorithm.trained_models()), flush=True)
    optimizer, scheduler = optimizer_of([p for p in policy.parameters() if p.requires_grad], t)
    return {"policy": policy, "ref": ref, "optimizer": optimizer, "scheduler": scheduler}


def optimizer_of(params: list, t) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``params`` and its learning-rate schedule, as the trainer section ``t`` sets them."""
    # one fused kernel per step on a GPU (as transformers' Trainer defaults to); sharded
    # parameters (DTensors) keep torch's default multi-tensor implementation
    fused = bool(params) and all(p.is_cuda and type(p.data) is torch.Tensor for p in params)
    optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, fused=fused or None)
    factor = functools.partial(lr_factor, t.warmup_steps, t.steps, t.lr_schedule, t.min_lr_ratio)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def follow_engine_positions(engine, parts: dict, model_config, config: RunConfig, main: bool) -> None:
    """A LongRoPE model's trained copies take the factors the engine's length selects (hybridrl.rope)."""
    context = engine.context_length()
    for model in (parts["policy"], parts["ref"]):
        if model is not None:
            rope.pin_long_rope(model, context)
    note = rope.describe(model_config, context, config.rollout.engine)
    if note and main:
        print(note, flush=True)


def lr_factor(warmup: int, steps: int, schedule: str, min_ratio: float, s: int) -> float:
    """The learning rate's share of ``trainer.lr`` at the update of step ``s + 1`` of ``steps``: a
    linear rise over ``warmup`` steps (from 1/warmup, never 0), then constant, or a linear or cosine
    decay whose progress is (s - warmup) / (steps - warmup), as transformers' schedules with warm-up,
    from 1 down towards ``min_ratio`` (reached after the last step)."""
    if s + 1 < warmup:
        return (s + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, max(0, s - warmup) / max(1, steps - warmup))
    decay = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * decay
