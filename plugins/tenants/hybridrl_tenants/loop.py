"""The tenants' loop: each step, every tenant in turn takes one RL step of its own (the core's
:meth:`hybridrl.trainer.Trainer.step` over a view of the run that holds the tenant's data, rewards,
algorithm, optimizer and folder), with its adapter in the policy's LoRA layers
(:class:`hybridrl_tenants.slots.Slots`) and in the engine.

Checkpoints: a step's checkpoint is one per tenant (``RUN_DIR/tenants/NAME/checkpoints/step-N``, the
core's format), then ``RUN_DIR/tenants.json`` names the step that every tenant has, written last and
whole: a resume loads every tenant at that step, so a kill between two tenants' checkpoints resumes
them all from the step before. Older checkpoints go (trainer.keep_last) only once it is written.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridrl import checkpoint as ckpt
from hybridrl import lora, plugins
from hybridrl.builtin.loggers import summary_line
from hybridrl.errors import ConfigError
from hybridrl.preflight import Checked
from hybridrl.prompts import PromptOrder
from hybridrl.rewards import Rewards
from hybridrl.rollout import RolloutStage
from hybridrl.run import Run, optimizer_of
from hybridrl.signals import StopSignals
from hybridrl.trainer import Trainer, between_steps
from hybridrl_tenants.configs import check_shape
from hybridrl_tenants.slots import Slots
from hybridrl_tenants.together import TenantRollout, Together

MARKER = "tenants.json"


@dataclass
class Tenant:
    """One tenant: its name, its LoRA factors (parameters of its own) and the trainer over its view of the run."""

    name: str
    params: dict[str, torch.nn.Parameter]
    trainer: Trainer

    @property
    def run(self) -> Run:
        return self.trainer.run


class Tenants:
    """The run's tenants over its one policy and engine: :meth:`train` is ``hybridrl tenants``."""

    def __init__(self, run: Run, configs: dict, checked: dict[str, Checked], folders: dict | None = None):
        """``folders``: the adapter folders tenants start from (:func:`hybridrl_tenants.configs.start_folders`)."""
        self.run, self.config = run, run.config
        self.slots = Slots(run.policy)
        start = self.slots.current()  # the adapter as the run built it (the engine holds it): every tenant's start
        for name, saved in (folders or {}).items():
            check_shape(name, saved, lora.adapter_config(run.policy))
        # the adapter alone: the engine session keeps each tenant's by name, and a step's rollouts are one call
        self.together = Together(run.session) if run.session.adapters and run.agent is None else None
        self.tenants = [self._tenant(name, configs[name], checked[name], start) for name in configs]
        for tenant in self.tenants:  # a tenant's own start: its folder's factors, each checked, in its parameters
            if tenant.name in (folders or {}):
                self.slots.use(tenant.params)
                lora.load_folder(run.policy, folders[tenant.name]["path"], folders[tenant.name])
        self.current = self.tenants[0]
        self.slots.use(self.current.params)
        if run.session.adapters or folders:  # each tenant's adapter by name; or the first's own start, merged
            self.load_all()
        named = zip(self.config.logging.loggers, run.loggers)  # rank 0's, in the config's order
        self.loggers = [logger for name, logger in named if name != "console"]  # every tenant's metrics, prefixed
        self.console = "console" in self.config.logging.loggers
        self.signals = StopSignals()

    def _tenant(self, name: str, tcfg, checked: Checked, start: dict) -> Tenant:
        """The tenant's view of the run: its config and folder, data, rewards, algorithm, optimizer and record."""
        run = self.run
        build = functools.partial(plugins.build, ctx=run.ctx)
        params = {n: torch.nn.Parameter(p.detach().clone()) for n, p in start.items()}
        optimizer, scheduler = optimizer_of(list(params.values()), tcfg.trainer)
        rewards = Rewards([(r, build("reward function", r.function, r.options)) for r in tcfg.rewards], run.ctx.device)
        prompts = PromptOrder(len(checked.data), tcfg.trainer.seed, tcfg.data.shuffle)
        checked.evaluation.connect(run.session, rewards, run.agent, build)
        folder = Path(tcfg.trainer.run_dir)
        record = dataclasses.replace(run.ctx, run_dir=folder)  # its metrics.jsonl and samples.jsonl
        loggers = [plugins.build("logger", "jsonl", tcfg.logging._options["jsonl"], record)] if run.ctx.is_main else []
        algorithm = build("algorithm", tcfg.algorithm.name, tcfg.algorithm.options)
        view = dataclasses.replace(
            run, config=tcfg, run_dir=folder, rewards=rewards, evaluation=checked.evaluation, loggers=loggers,
            data=checked.data, prompts=prompts, algorithm=algorithm, optimizer=optimizer, scheduler=scheduler,
            rollout=self._stage(name, checked.data, prompts, tcfg),
        )  # fmt: skip
        return Tenant(name, params, Trainer(view))

    def _stage(self, name: str, data, prompts: PromptOrder, tcfg) -> RolloutStage:
        stage = (self.run.session, data, prompts, self.run.tokenizer, tcfg, self.run.agent)
        return TenantRollout(self.together, name, *stage) if self.together is not None else RolloutStage(*stage)

    def enter(self, tenant: Tenant, force: bool = False) -> None:
        """The policy computes with ``tenant``'s adapter and the engine samples with it: the engine session's
        calls name it (the adapter alone: the session sends it, where the engine does not hold it), or its merged
        weights are sent. ``force``: send it even where the engine holds it."""
        if tenant is self.current and not force:
            return
        self.slots.use(tenant.params)
        self.run.session.adapter = tenant.name if self.run.session.adapters else None
        if force or not self.run.session.adapters:
            tenant.trainer.sync(update=False)
        self.current = tenant

    def load_all(self) -> None:
        """Send every tenant's adapter (the engine session keeps each by name), or the first's merged weights."""
        for tenant in self.tenants if self.run.session.adapters else self.tenants[:1]:
            self.enter(tenant, force=True)
        self.enter(self.tenants[0])

    # -- the loop -----------------------------------------------------------------------------

    def train(self) -> dict[str, dict[str, float]]:
        """Every step, each tenant's step in turn; evaluation and checkpoints as the trainer section says.
        Returns each tenant's last metrics."""
        t = self.config.trainer
        start = self.resume() if t.resume else 0
        self.open(t.steps, start)
        last: dict[str, dict[str, float]] = {}
        finished = False
        try:
            with self.signals.catch():
                if t.eval_before_train and start == 0:
                    self.evaluate(0)
                for step in range(start + 1, t.steps + 1):
                    last = self.step(step)
                    between_steps(t, step, self.signals, self.evaluate, self.save, "tenants", self.run.run_dir)
            finished = True
        finally:
            self.close(last, finished)
        return last

    def step(self, step: int) -> dict[str, dict[str, float]]:
        out, combined = {}, {}
        for tenant in self.tenants:
            self.enter(tenant)
            out[tenant.name] = metrics = tenant.trainer.step(step)
            combined |= {f"{tenant.name}/{k}": v for k, v in metrics.items()}
            self.say(tenant, step, metrics)
        for logger in self.loggers:
            logger.log(step, combined)
        return out

    def evaluate(self, step: int) -> None:
        combined = {}
        for tenant in self.tenants:
            if tenant.run.evaluation.sets:
                self.enter(tenant)
                metrics = tenant.trainer.evaluate(step)
                combined |= {f"{tenant.name}/{k}": v for k, v in metrics.items()}
                self.say(tenant, step, metrics)
        for logger in self.loggers if combined else ():
            logger.log(step, combined)

    def say(self, tenant: Tenant, step: int, metrics: dict[str, float]) -> None:
        if self.console and self.run.ctx.is_main:
            print(f"{tenant.name}: {summary_line(step, self.config.trainer.steps, metrics)}", flush=True)

    def open(self, steps: int, start: int) -> None:
        """Start every record: the run's loggers, each tenant's (and on_train_start with each tenant's view)."""
        for logger in self.loggers:
            logger.open(steps, start)
        for tenant in self.tenants:
            tenant.trainer.start_step = start
            tenant.trainer.open(steps)

    def close(self, last: dict, finished: bool) -> None:
        """End each tenant's record (on_train_end), release its rewards and eval sets, then the run."""
        try:
            for tenant in self.tenants:
                trainer = tenant.trainer
                trainer.pm.hook.on_train_end(run=tenant.run, metrics=last.get(tenant.name, {}))
                for logger in tenant.run.loggers:
                    logger.close()
                trainer.probes.close()
                tenant.run.rewards.close()
                tenant.run.evaluation.close()
            for logger in self.loggers:
                logger.close()
        finally:
            self.run.close(together=finished)

    # -- checkpoints ----------------------------------------------------------------------------

    def save(self, step: int, weights_only: bool = False) -> Path:
        """Each tenant's checkpoint of ``step``, then the marker that names it (written whole), then the
        older checkpoints go. Returns the marker's path."""
        paths = []
        for tenant in self.tenants:
            self.slots.use(tenant.params)
            comps = tenant.trainer.stateful_components()
            paths.append(ckpt.save_checkpoint(tenant.run, comps, step, weights_only))
        self.slots.use(self.current.params)
        marker = self.run.run_dir / MARKER
        fd, tmp = tempfile.mkstemp(prefix=f".{MARKER}.", dir=self.run.run_dir)
        with os.fdopen(fd, "w") as f:
            json.dump({"step": step, "tenants": [t.name for t in self.tenants]}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, marker)
        for tenant, path in zip(self.tenants, paths, strict=True):
            ckpt.rotate(tenant.run.run_dir, self.config.trainer.keep_last, path)
            tenant.trainer.pm.hook.on_checkpoint(run=tenant.run, step=step, path=path)
        return marker

    def resume(self) -> int:
        """Load every tenant at the step the marker names; the step (0: none saved yet)."""
        marker = self.run.run_dir / MARKER
        if not marker.is_file():
            print(f"no checkpoint of the tenants in {self.run.run_dir}: starting at step 1", flush=True)
            return 0
        saved = json.loads(marker.read_text())
        step, names = int(saved["step"]), [t.name for t in self.tenants]
        if saved["tenants"] != names:
            raise ConfigError(
                f"{marker} holds the tenants {', '.join(saved['tenants'])} and this config names {', '.join(names)}: "
                "resume with the same tenants, in the same order, or start a new trainer.run_dir."
            )
        for tenant in self.tenants:
            self.slots.use(tenant.params)
            ckpt.clean_partial(tenant.run.run_dir)
            path = ckpt.checkpoint_dir(tenant.run.run_dir) / f"step-{step:06d}"
            try:
                ckpt.load_checkpoint(tenant.run, tenant.trainer.stateful_components(), path)
            except (ckpt.CheckpointError, ValueError, FileNotFoundError) as e:
                raise ckpt.CheckpointError(f"tenant '{tenant.name}': {e}") from None
            ckpt.drop_logs_after(tenant.run.run_dir, step, self.run.ctx.is_main)
        ckpt.drop_logs_after(self.run.run_dir, step, self.run.ctx.is_main)
        self.load_all()
        print(f"resumed the tenants {', '.join(names)} from step {step}", flush=True)
        return step
