"""The RL loop: rollout -> reward -> logprobs -> advantages -> update -> weight sync -> log.

:func:`hybridrl.run.build_run` builds every part from the config (a :class:`~hybridrl.run.Run`);
``Trainer`` runs the loop over it, and ``Trainer.step``, one RL step, reads as the pipeline. The
stages' work lives in modules of their own: ``rollout`` (prompts to responses), ``rewards``
(scores), ``update`` (the training loop of every trained model), ``metrics``, ``checkpoint``;
docs/architecture.md has the map.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

from hybridrl import checkpoint as ckpt
from hybridrl import distributed, lora, plugins
from hybridrl import functional as F
from hybridrl.batch import Batch, drop_padding, even_out, first_groups, real_rows, with_branches
from hybridrl.components import Trainable
from hybridrl.engine_weights import engine_tensors
from hybridrl.errors import Interrupted, StageError, nonfinite
from hybridrl.forward import Outputs
from hybridrl.metrics import (
    Timer,
    WeightedStats,
    batch_metrics,
    mismatch_metrics,
    reduce_metrics,
    sample_rows,
    update_throughput,
)
from hybridrl.models import is_checkpointing
from hybridrl.probes import StepProbes
from hybridrl.run import Run
from hybridrl.signals import StopSignals
from hybridrl.stream import make_prefetcher
from hybridrl.update import mini_batch_rows, run_update


class Trainer:
    """The loop over a :class:`~hybridrl.run.Run`: train, step, train_on, sync, save, log, close.
    ``Trainer(build_run(config)).train()`` is ``hybridrl train``."""

    def __init__(self, run: Run):
        if not isinstance(run, Run):
            raise TypeError(f"Trainer takes a Run, not {type(run).__name__}: Trainer(build_run(config)).")
        self.run = run
        self.start_step = 0
        self.extra_state: dict = {}  # more objects whose state_dict goes into checkpoints (hybridrl serve's learner)
        self.signals = StopSignals()
        self.pm = plugins.get_plugin_manager()
        self.probes = StepProbes()  # what a step measures beside its stages (garbage collection, compiling)
        lora_options = run.config.model.lora
        if lora_options and lora_options.path and not run.session.adapters:  # the engine holds the bare base
            self.sync(update=False)
        self.prefetch = make_prefetcher(run, self.collect)

    @property
    def config(self):
        """The run's config (read-only)."""
        return self.run.config

    def stateful_components(self) -> dict:
        """Components whose state goes into checkpoints (they define state_dict/load_state_dict)."""
        found = {"algorithm": self.run.algorithm, **self.run.rewards.stateful(), "prefetch": self.prefetch}
        found |= {"engine_session": self.run.session, **self.extra_state}
        return {k: v for k, v in found.items() if hasattr(v, "state_dict") and hasattr(v, "load_state_dict")}

    # -- the loop ---------------------------------------------------------------------------

    def train(self) -> dict[str, float]:
        t = self.config.trainer
        if t.resume:
            self.resume()
        self.open(t.steps)
        metrics: dict[str, float] = {}
        finished = False
        try:
            with self.signals.catch():
                if t.eval_before_train and self.start_step == 0:
                    self.evaluate(0)
                for step in range(self.start_step + 1, t.steps + 1):
                    try:
                        metrics = self.step(step)
                        if step == self.start_step + 1:
                            self.probes.after_first_step()
                    except Exception as e:  # a collective that failed: say which rank went missing
                        if distributed.world_size() == 1 or not distributed.is_collective_failure(e):
                            raise
                        raise distributed.RankFailure(distributed.describe_failure(e, step, t.timeout_s)) from e
                    between_steps(t, step, self.signals, self.evaluate, self.save, "train", self.run.run_dir)
            finished = True
        finally:
            self.close(metrics, finished)
        return metrics

    def open(self, steps: int = 0) -> None:
        """Start the run's record: the loggers (``steps``: the run's last step; 0: none, ``hybridrl
        serve``), then ``on_train_start``. :meth:`close` ends it."""
        for logger in self.run.loggers:
            logger.open(steps, self.start_step)
        self.probes = StepProbes(self.run.ctx.is_main)
        self.probes.open()
        self.pm.hook.on_train_start(run=self.run, start_step=self.start_step)

    def close(self, metrics: dict[str, float] | None = None, finished: bool = False) -> None:
        """End the run: ``on_train_end`` with the last metrics, then the loggers, the rewards, the
        prefetcher, the engine and the process group are released; ``finished``: the run ended
        normally on every rank, which then leave the process group together."""
        self.pm.hook.on_train_end(run=self.run, metrics=metrics or {})
        for logger in self.run.loggers:
            logger.close()
        if self.prefetch is not None:
            self.prefetch.close()
        self.probes.close()
        self.run.close(together=finished)

    def save(self, step: int, weights_only: bool = False) -> Path:
        path = ckpt.save_checkpoint(self.run, self.stateful_components(), step, weights_only)
        if self.run.ctx.is_main:
            ckpt.rotate(self.run.run_dir, self.config.trainer.keep_last, path)
        distributed.barrier()
        self.pm.hook.on_checkpoint(run=self.run, step=step, path=path)
        return path

    def resume(self) -> None:
        """Load the newest checkpoint of run_dir that loads (a damaged one is skipped with a warning)
        and continue after its step."""
        found = ckpt.load_newest(self.run, self.stateful_components())
        if found is not None:
            path, self.start_step = found
            ckpt.drop_logs_after(self.run.run_dir, self.start_step, self.run.ctx.is_main)
            if not self.run.session.updates:  # a checkpoint written before the session kept its count
                self.run.session.updates = self.run.session.version = self.start_step
            self.sync(update=False)
            if self.run.ctx.is_main:
                print(f"resumed from {path} (step {self.start_step})", flush=True)

    def evaluate(self, step: int) -> dict[str, float]:
        """Evaluate the data.eval sets with the weights the engine holds, between two steps (0: before
        the first); their metrics go to the loggers at ``step`` (docs/evaluation.md). With
        rollout.async, the batches queued were finished before the last sync, so eval changes none."""
        if not self.run.evaluation.sets:
            return {}
        distributed.heartbeat(step, "eval")
        if self.prefetch is not None:
            self.prefetch.before_sync()
        metrics = self.run.evaluation.run(step, self.run.run_dir)
        for logger in self.run.loggers:
            logger.log(step, metrics)
        return metrics

    def nonfinite(self, step: int, what: str) -> None:
        """Abort with a clear message, or (trainer.on_nonfinite=skip) warn and let the caller skip."""
        nonfinite(step, what, self.config.trainer.on_nonfinite, ckpt.latest_checkpoint(self.run.run_dir))

    def step(self, step: int) -> dict[str, float]:
        """One RL step. Ranks take the same branches: the update and the sync are collective."""
        timer = Timer(self.run.ctx.device, on_enter=lambda stage: distributed.heartbeat(step, stage))
        self.probes.start()
        check, first = self.run.session.check, step == self.start_step + 1
        start, start_error = {}, None  # the engine before any sync: its precision and conventions
        if first:
            with timer("sync_check"):
                resync = lambda: self.sync(update=False)  # noqa: E731
                start, start_error = check.start(self.probe_prompt, step, self.probe_logprobs, step > 1, resync)
        rollout, kept, metrics = self.rollouts(step, timer)
        metrics |= start
        batch = self.trainable(step, kept, rollout)  # None: nothing to train on this step
        if batch is not None:
            trained, batch = self.train_on(batch, step, timer)
            metrics |= trained
        if self.prefetch is not None:  # the batches queued come from the weights they were queued with
            self.prefetch.before_sync()
        with timer("sync"):  # also after a skipped update: an engine may have released its weights in sleep()
            self.sync()
        if start_error is None:
            with timer("sync_check"):
                metrics |= check.after_sync(self.probe_prompt, step, self.probe_logprobs, first)
        metrics |= self.run.session.metrics()
        metrics["batch/trained_fraction"] = (
            real_rows(batch, branches=False) / len(rollout) if batch is not None else 0.0
        )
        generating = timer.times.get("rollout", metrics.get("async/rollout_s", 0.0))
        metrics |= batch_metrics(rollout if batch is None else batch, generating, rollout) | timer.metrics()
        metrics |= self.probes.finish(step, first)  # garbage collection and compiling, within the stages above
        if batch is not None:
            t = self.config.trainer
            seconds, shared = timer.times["update"], self.share_prompts and not is_checkpointing(self.run.policy)
            metrics |= update_throughput(self.run.policy, batch, t.epochs, seconds, self.run.ctx.device, shared)
        metrics = self.log(step, metrics, rollout if batch is None else batch)
        if start_error is not None:  # after the step's metrics are written: they diagnose it
            raise StageError(start_error)
        return metrics

    def train_on(
        self, batch: Batch, step: int, timer: Timer | None = None, advantages: torch.Tensor | None = None
    ) -> tuple[dict[str, float], Batch | None]:
        """Train on a scored batch (on the policy's device, the same rows on every rank): the
        logprobs it needs, the algorithm's advantages, the update of every trained model. Returns
        the metrics and the batch, or None in its place when the advantages were NaN/Inf and
        ``trainer.on_nonfinite: skip`` skipped the update. ``advantages``: (B, T) advantages the
        caller computed, in place of the algorithm's estimator (a face that knows each response's
        baseline, as serve's ratings); the algorithm's loss is the same."""
        timer = timer or Timer(self.run.ctx.device)
        with timer("logprobs"):
            metrics = self.compute_logprobs(batch)
        with timer("advantages"):
            if advantages is None:
                metrics |= self.run.algorithm.compute_advantages(batch)
            else:
                batch["advantages"] = advantages.to(self.run.ctx.device, torch.float32)
        if distributed.any_rank(not torch.isfinite(batch["advantages"]).all()):
            self.nonfinite(step, f"the advantages of algorithm '{self.config.algorithm.name}' are NaN/Inf")
            return metrics, None
        with timer("update"):
            metrics |= self.update(batch, step)
        return metrics, batch

    def sync(self, update: bool = True) -> None:
        """Send the policy's weights to the engine; ``update``: they hold a new policy update (else
        the same weights again: a resume, a resync before the first update)."""
        if self.run.session.adapters:  # the adapter alone (model.lora.sync)
            version = self.run.session.updates + update
            self.run.session.sync(lambda: lora.adapter(self.run.strategy, self.run.policy, version), update)
        else:
            self.run.session.sync(self.policy_tensors, update)

    @property
    def probe_prompt(self) -> list[int]:
        """The sync check's prompt (:class:`hybridrl.session.SyncCheck`)."""
        return self.run.rollout.probe_prompt

    def probe_logprobs(self, probe: Batch) -> torch.Tensor:
        """The policy's logprobs of a sync-check probe's tokens (B, T), in one pass."""
        return self.run.passes.logprobs(
            self.run.policy, probe, self.config.rollout.temperature, "policy", one_pass=True
        )

    # -- stages -----------------------------------------------------------------------------

    def rollouts(self, step: int, timer: Timer) -> tuple[Batch, Batch, dict[str, float]]:
        """This step's rollouts, kept groups and metrics: generated now (the session wakes the engine for
        them and puts it to sleep before training), or taken from those generated while the last steps
        trained (rollout.async)."""
        if self.prefetch is not None:
            with timer("rollout_wait"):
                return self.prefetch.take(step)
        out = self.collect(step, timer)  # the session wakes the engine as its calls need
        self.run.session.before_training()  # the update comes next: the session puts the engine to sleep
        return out

    def collect(self, step: int, timer: Timer, generate=None) -> tuple[Batch, Batch, dict[str, float]]:
        """Rollout and reward rounds, then the algorithm's filter: one round, or with
        rollout.refill_rounds more until every rank keeps its share of groups. Returns the rollouts
        of every round, the groups kept, and the metrics, the filter's last call's among them (they
        travel with the batch: rollout.async runs this on the prefetch thread, steps ahead).
        ``generate(step, round_)``: a round's groups (the rollout stage's; rollout.stream's)."""
        generate = generate or self.run.rollout.generate
        refill, share = (
            self.config.rollout.refill_rounds,
            self.config.trainer.prompts_per_step // self.run.ctx.world_size,
        )
        rounds, round_metrics = [], defaultdict(list)
        for round_ in range(1 + refill):
            with timer("rollout"):
                rounds.append(generate(step, round_))
            with timer("reward"):
                for k, v in self.run.rewards.score(rounds[-1]).items():  # each round is scored as it comes
                    round_metrics[k].append(v)
                rollout = Batch.cat(rounds, self.run.tokenizer.pad_token_id) if round_ else rounds[0]
                kept = self.run.algorithm.filter_batch(rollout)  # all rounds: its metrics cover them all
                kept, filtered = kept if isinstance(kept, tuple) else (kept, {})  # a bare Batch: no metrics
            if round_ == refill or distributed.all_ranks(kept.groups() >= share):
                break  # every rank kept its share of groups (always, when the algorithm drops none)
        self.run.rollout.release(rollout)  # every round is scored
        metrics = {k: sum(v) / len(v) for k, v in round_metrics.items()}  # rounds are the same size
        if len(rounds) > 1:  # the statistics of all the rounds' responses together
            metrics |= self.run.rewards.stats(rollout)
            kept = first_groups(kept, share)
        return rollout, kept, metrics | filtered | {"rollout/rounds": len(rounds)}

    def trainable(self, step: int, kept: Batch, rollout: Batch) -> Batch | None:
        """The kept groups with padding rows up to every rank's row count, on the policy's device;
        None when no rank kept any, or when a combined reward is NaN/Inf."""
        bad = distributed.any_rank(len(kept) > 0 and not torch.isfinite(kept["scores"]).all())
        if bad:
            self.nonfinite(step, "the combined reward is NaN/Inf")
        if bad or distributed.all_ranks(len(kept) == 0):
            return None
        kept = with_branches(kept, self.run.tokenizer.pad_token_id)  # an agent episode's earlier branches
        return even_out(kept, rollout).to(self.run.ctx.device)

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch) -> dict[str, float]:
        """Old logprobs when the step makes several updates; reference logprobs when needed."""
        metrics, temperature = {}, self.config.rollout.temperature
        if not self._on_policy(len(batch)) or self.run.algorithm.needs_old_logprobs:
            batch["old_logprobs"] = self.run.passes.logprobs(self.run.policy, batch, temperature, "policy")
            stats = WeightedStats()
            mask = batch["response_mask"]
            stats.add(mismatch_metrics(batch["rollout_logprobs"], batch["old_logprobs"], mask), float(mask.sum()))
            metrics |= stats.result()
        if self.run.ref is not None:
            batch["ref_logprobs"] = self.run.passes.logprobs(self.run.ref, batch, temperature, "reference model")
        elif self.run.algorithm.needs_reference:  # LoRA: the base model is the reference
            with lora.adapter_off(self.run.policy):
                what = "reference model (adapters off)"
                batch["ref_logprobs"] = self.run.passes.logprobs(self.run.policy, batch, temperature, what)
        return metrics

    def policy_tensors(self, weight_format: str | None = None):
        """The policy's full weights for the engine (LoRA: merged), in the format it loads
        (``weight_format``, default the engine's: see :mod:`hybridrl.engine_weights`)."""
        policy = self.run.policy
        tensors = self.run.strategy.full_tensors(policy)
        tensors = lora.merged_tensors(tensors, lora.adapted_layers(policy)) if self.config.model.lora else tensors
        return engine_tensors(policy, tensors, weight_format or self.run.engine.weight_format)

    @property
    def share_prompts(self) -> bool:
        """Whether the passes share prompts: trainer.share_prompts as the pass planner resolved it."""
        return self.run.passes.planner.share

    def _on_policy(self, batch_size: int) -> bool:
        t = self.config.trainer
        return t.epochs == 1 and mini_batch_rows(t.mini_batch_size, batch_size) >= batch_size

    def update(self, batch: Batch, step: int) -> dict[str, float]:
        """The update stage: the policy, then the models the algorithm trains (a critic), one loop."""
        t = self.config.trainer
        settings = dict(
            seed=t.seed,
            passes=self.run.passes,
            on_nonfinite=lambda what: self.nonfinite(step, what),
        )
        metrics = {}
        for trainable in [self.policy_trainable(), *self.run.algorithm.trained_models()]:
            metrics |= run_update(trainable, batch, step, self.run.strategy, **settings)
        return metrics

    def policy_trainable(self) -> Trainable:
        t = self.config.trainer
        return Trainable(
            name="actor",
            label=f"policy (algorithm '{self.config.algorithm.name}')",
            model=self.run.policy,
            optimizer=self.run.optimizer,
            loss=self.policy_loss,
            aggregation=self.run.algorithm.loss_aggregation,
            epochs=t.epochs,
            mini_batch_size=t.mini_batch_size,
            max_grad_norm=t.max_grad_norm,
            scheduler=self.run.scheduler,
        )

    def policy_loss(self, part: Batch):
        """The algorithm's loss of a micro-batch (the rows of a planned pass), from the policy's
        logprobs and entropies."""
        out = Outputs(self.config.rollout.temperature, entropy=True, entropy_grad=self.run.algorithm.needs_entropy_grad)
        logprobs, entropy = self.run.passes.pass_logprobs(self.run.policy, part, out, "policy")
        mask = part["response_mask"]
        metrics = {"actor/entropy": F.masked_mean(entropy, mask).detach()}
        if "old_logprobs" not in part:  # one update: the sampling policy is the one being updated
            part["old_logprobs"] = logprobs.detach()
            metrics |= mismatch_metrics(part["rollout_logprobs"], part["old_logprobs"], mask)
        loss, m = self.run.algorithm.loss(part, logprobs, entropy)
        return loss, metrics | m

    def log(self, step: int, metrics: dict[str, float], batch: Batch) -> dict[str, float]:
        """One value per metric over all ranks, to the hooks and the loggers; samples every few steps."""
        metrics = reduce_metrics(metrics)
        self.pm.hook.on_step_end(run=self.run, step=step, metrics=metrics, batch=batch)
        every = self.config.trainer.sample_every
        samples = None
        if every and step % every == 0:
            samples = distributed.gather_lists(sample_rows(drop_padding(batch), self.run.rewards.labels))
        for logger in self.run.loggers:
            logger.log(step, metrics)
            if samples is not None:
                logger.log_samples(step, samples)
        return metrics


def between_steps(t, step: int, signals: StopSignals, evaluate, save, command: str, run_dir: Path) -> None:
    """After ``step``: ``evaluate(step)`` and ``save(step, weights_only)`` (the checkpoint's path) as the
    trainer section ``t`` schedules them; where a stop signal came (``signals``), save and stop with
    the way to go on (``hybridrl COMMAND CONFIG --resume``)."""
    stop = signals.agree()
    last = step == t.steps and not stop
    if (last and t.eval_after_train) or (t.eval_every and step % t.eval_every == 0 and not stop):
        evaluate(step)
    if stop or (last and t.save_final) or (t.save_every and step % t.save_every == 0):
        path = save(step, weights_only=last and t.save_final == "weights")
    if stop:
        raise Interrupted(
            f"stopped by {stop} after step {step}; checkpoint {path}. "
            f"Continue with: hybridrl {command} CONFIG --resume trainer.run_dir={run_dir}",
            signals.exit_code,
        )
