"""Building a run: every component from the config, checks that need no model first so that bad
input fails fast, then the models, the engine and its session. :class:`TrainerSetup` is the part
of :class:`hybridrl.trainer.Trainer` that builds; ``hybridrl eval`` builds from it what evaluation
needs alone (:meth:`TrainerSetup.evaluate_only`)."""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import torch

from hybridrl import checkpoint as ckpt
from hybridrl import distributed, lora, plugins, preflight, rope
from hybridrl.agents import build_agent
from hybridrl.config_files import write_config
from hybridrl.errors import ConfigError
from hybridrl.memory import MicroBatches
from hybridrl.models import disable_dropout, end_token_ids, load_causal_lm
from hybridrl.passes import Planner, Runner
from hybridrl.prefetch import make_prefetcher
from hybridrl.prompts import PromptOrder
from hybridrl.rewards import Rewards
from hybridrl.rollout import RolloutStage
from hybridrl.session import EngineSession


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


class TrainerSetup:
    """Builds what a :class:`~hybridrl.trainer.Trainer` runs (its ``config`` and ``run_dir`` set)."""

    def setup(self) -> None:
        """Build every component. Checks that need no model run first, so bad input fails fast."""
        cfg, t = self.config, self.config.trainer
        ckpt.seed_everything(t.seed)
        if t.threads:
            torch.set_num_threads(t.threads)
        torch.backends.cuda.enable_cudnn_sdp(t.cudnn_attention)  # the process's; no-op without CUDA
        device = self.setup_distributed()
        checked = preflight.check(cfg, device, self.run_dir)  # every check that needs no model
        model_path, model_config = checked.model_path, checked.model_config
        self.tokenizer, self.ctx, self.data = checked.tokenizer, checked.ctx, checked.data
        self.evaluation = checked.evaluation  # the data.eval sets, checked
        self.prompts = PromptOrder(len(self.data), t.seed, cfg.data.shuffle)
        # created the owner's alone (configs, logs, samples, checkpoints); by every rank at once under torchrun
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.ctx.is_main:
            write_config(self.run_dir / "config.yaml", cfg)

        self.strategy = self._build("sharding strategy", cfg.sharding.strategy, cfg.sharding.options)
        budget = MicroBatches(t.micro_batch_size, t.micro_batch_tokens, model_config, self.strategy, device)
        planner = Planner(t.share_prompts, t.pack_sequences, budget, device, self.strategy.pack_width)
        self.passes = Runner(planner, self.strategy, device)
        # the context every later component gets: complete, with the run's services
        self.ctx = dataclasses.replace(self.ctx, strategy=self.strategy, passes=self.passes)
        self.algorithm = self._build("algorithm", cfg.algorithm.name, cfg.algorithm.options)
        self.rewards = Rewards(
            [(r, self._build("reward function", r.function, r.options)) for r in cfg.rewards], device
        )
        self.setup_models(model_path)
        self.engine = self._build("rollout engine", cfg.rollout.engine, cfg.rollout.options)
        self.follow_engine_positions(model_config)
        pad = self.tokenizer.pad_token_id
        self.session = EngineSession(self.engine, cfg.rollout, t.seed, t.prompts_per_step, pad)  # its only caller
        agent = build_agent(self._build, cfg, self.session, self.tokenizer, end_token_ids(model_path, self.tokenizer))
        self.rollout = RolloutStage(self.session, self.data, self.prompts, self.tokenizer, cfg, agent)
        self.prefetch = make_prefetcher(cfg, self.session, self.collect, self.ctx.is_main)
        self.evaluation.connect(self.session, self.rewards, agent, self._build)
        loggers = cfg.logging.loggers if self.ctx.is_main else []  # rank 0 writes the run's record
        self.loggers = [self._build("logger", n, cfg.logging._options[n]) for n in loggers]

    def evaluate_only(self, step: int = 0) -> list:
        """``hybridrl eval``: build what evaluation needs alone (the data.eval sets, the rewards, the
        engine loaded from model.path and its session, the agent loop where the run has one; no
        policy, no training data, any number of torchrun ranks), evaluate every set (``step`` names
        the samples), release it all; returns the sets' :class:`~hybridrl.evaluation.SetResult`."""
        cfg, t = self.config, self.config.trainer
        ckpt.seed_everything(t.seed)
        if t.threads:
            torch.set_num_threads(t.threads)
        torch.backends.cuda.enable_cudnn_sdp(t.cudnn_attention)  # the process's; no-op without CUDA
        device = preflight.run_device(cfg)
        distributed.setup(device, timeout_s=t.timeout_s)
        self.run_dir = Path(distributed.broadcast_object(str(self.run_dir)))
        try:
            checked = preflight.check(cfg, device, self.run_dir, train=False)  # every check that needs no model
            model_path, self.tokenizer, self.ctx = checked.model_path, checked.tokenizer, checked.ctx
            self.evaluation = checked.evaluation
            self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            self.rewards = Rewards(
                [(r, self._build("reward function", r.function, r.options)) for r in cfg.rewards], device
            )
            self.session = EngineSession(
                self._build("rollout engine", cfg.rollout.engine, cfg.rollout.options),
                cfg.rollout,
                t.seed,
                t.prompts_per_step,
                self.tokenizer.pad_token_id,
            )
            agent = build_agent(
                self._build, cfg, self.session, self.tokenizer, end_token_ids(model_path, self.tokenizer)
            )
            self.evaluation.connect(self.session, self.rewards, agent, self._build)
            return self.evaluation.evaluate(step)
        finally:
            for part in ("evaluation", "rewards", "session"):
                if hasattr(self, part):
                    getattr(self, part).close()
            distributed.teardown()

    def setup_models(self, model_path: str) -> None:
        """The policy (with its LoRA adapters), the reference when the algorithm needs one, the
        optimizer and its schedule, placed by the sharding strategy."""
        cfg, t = self.config, self.config.trainer

        def load(adapters=None):
            model = load_causal_lm(
                model_path,
                self.ctx.dtype,
                torch.device("cpu"),
                cfg.model.trust_remote_code,
                cfg.model.attn_implementation,
            )
            model = lora.apply_lora(model, adapters) if adapters else model
            return model if cfg.model.dropout else disable_dropout(model)

        self.policy = self.strategy.wrap(load(cfg.model.lora).train(), trainable=True)
        self.ref = None  # with LoRA the reference is the policy with its adapters off
        if self.algorithm.needs_reference and not cfg.model.lora:
            self.ref = self.strategy.wrap_reference(load().eval().requires_grad_(False))
        if cfg.model.lora and self.ctx.is_main:
            print(lora.describe(self.policy, cfg.model.lora, self.algorithm.trained_models()), flush=True)
        params = [p for p in self.policy.parameters() if p.requires_grad]
        # one fused kernel per step on a GPU (as transformers' Trainer defaults to); sharded
        # parameters (DTensors) keep torch's default multi-tensor implementation
        fused = bool(params) and all(p.is_cuda and type(p.data) is torch.Tensor for p in params)
        self.optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, fused=fused or None)
        factor = functools.partial(lr_factor, t.warmup_steps, t.steps, t.lr_schedule, t.min_lr_ratio)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)

    def follow_engine_positions(self, model_config) -> None:
        """A LongRoPE model's trained copies take the factors the engine's length selects (hybridrl.rope)."""
        context = self.engine.context_length()
        for model in (self.policy, self.ref):
            if model is not None:
                rope.pin_long_rope(model, context)
        note = rope.describe(model_config, context, self.config.rollout.engine)
        if note and self.ctx.is_main:
            print(note, flush=True)

    def setup_distributed(self) -> torch.device:
        """This process's device; under torchrun, check the config for N ranks, join the process
        group, and take rank 0's run directory."""
        cfg = self.config
        device = preflight.run_device(cfg)
        try:
            multi_process = plugins.lookup("sharding strategy", cfg.sharding.strategy).multi_process
        except plugins.PluginError as e:
            raise ConfigError(str(e)) from None
        preflight.check_world(cfg, distributed.env_world()[1], multi_process)
        distributed.setup(device, timeout_s=cfg.trainer.timeout_s)
        self.run_dir = Path(distributed.broadcast_object(str(self.run_dir)))
        return device

    def _build(self, kind: str, name: str, options):
        return plugins.build(kind, name, options, self.ctx)
