"""The RL loop: rollout -> reward -> logprobs -> advantages -> update -> weight sync -> log."""

from __future__ import annotations

import contextlib
import random
import signal
import sys
import threading
import time
from collections import defaultdict
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import torch

from hybridrl import checkpoint as ckpt
from hybridrl import distributed, plugins
from hybridrl import functional as F
from hybridrl.batch import Batch, drop_padding, even_out, first_groups
from hybridrl.components import RunContext, SamplingParams
from hybridrl.config import RunConfig, dump_config
from hybridrl.errors import ConfigError, Interrupted, NonFiniteError, StageError, stage_errors  # noqa: F401
from hybridrl.metrics import (
    WeightedStats,
    batch_metrics,
    mismatch_metrics,
    reduce_metrics,
    sample_rows,
    update_throughput,
)
from hybridrl.models import (
    DTYPES,
    check_model_path,
    disable_dropout,
    load_causal_lm,
    load_tokenizer,
    resolve_model_path,
    response_logprobs,
)
from hybridrl.shaping import ShapingState
from hybridrl.update import Trainable, micro_batches, mini_batch_rows, run_update


class Trainer:
    def __init__(self, config: RunConfig, name: str = "run"):
        self.config = config
        t = config.trainer
        if t.resume and not t.run_dir:
            raise ConfigError("trainer.resume (--resume) needs trainer.run_dir: the directory of the run to continue.")
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        self.run_dir = Path(t.run_dir or f"runs/{name}-{stamp}")
        self.start_step = 0
        self.stop_signal: str | None = None
        self.pm = plugins.get_plugin_manager()

    # -- setup ------------------------------------------------------------------------------

    def setup(self) -> None:
        """Build every component. Checks that need no model run first, so bad input fails fast."""
        cfg, t = self.config, self.config.trainer
        seed_everything(t.seed)
        if t.threads:
            torch.set_num_threads(t.threads)
        device = self.setup_distributed()
        check_model_path(cfg.model.path, cfg.model.gguf_file)
        if not t.resume and ckpt.list_checkpoints(self.run_dir):
            raise ConfigError(
                f"{self.run_dir} already holds checkpoints. Continue that run with --resume "
                "(trainer.resume=true), or choose a new trainer.run_dir."
            )
        self.ctx = RunContext(
            model_path="",
            tokenizer=None,
            device=device,
            dtype=DTYPES[cfg.model.dtype],
            seed=t.seed,
            run_dir=self.run_dir,
            rank=distributed.rank(),
            world_size=distributed.world_size(),
            local_rank=distributed.env_world()[2],
            trust_remote_code=cfg.model.trust_remote_code,
            dropout=cfg.model.dropout,
            response_tokens=cfg.rollout.max_tokens,
        )
        self.data = self._build("dataset", cfg.data.source, cfg.data.options)
        check_columns(self.data, cfg)
        self.prompts = PromptOrder(len(self.data), t.seed, cfg.data.shuffle)

        with distributed.main_first():  # one rank converts a GGUF file into the shared cache
            model_path = resolve_model_path(cfg.model.path, cfg.model.gguf_file)
        self.tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code)
        self.ctx.model_path, self.ctx.tokenizer = model_path, self.tokenizer
        for i in range(min(len(self.data), 256)):  # prompt lengths, before any model is loaded
            encode_prompt(self.data[i], cfg.data, self.tokenizer)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.ctx.is_main:
            (self.run_dir / "config.yaml").write_text(dump_config(cfg))

        self.strategy = self._build("sharding strategy", cfg.sharding.strategy, cfg.sharding.options)
        self.ctx.strategy = self.strategy
        self.algorithm = self._build("algorithm", cfg.algorithm.name, cfg.algorithm.options)
        self.rewards = [(r, self._build("reward function", r.function, r.options)) for r in cfg.rewards]
        self.shaping = ShapingState()  # the rewards' running statistics, checkpointed

        def load():
            model = load_causal_lm(model_path, self.ctx.dtype, torch.device("cpu"), cfg.model.trust_remote_code)
            return model if cfg.model.dropout else disable_dropout(model)

        self.policy = self.strategy.wrap(load().train(), trainable=True)
        self.ref = None
        if self.algorithm.needs_reference:
            self.ref = self.strategy.wrap_reference(load().eval().requires_grad_(False))
        params = [p for p in self.policy.parameters() if p.requires_grad]
        # one fused kernel per step on a GPU (as transformers' Trainer defaults to); sharded
        # parameters (DTensors) keep torch's default multi-tensor implementation
        fused = bool(params) and all(p.is_cuda and type(p.data) is torch.Tensor for p in params)
        self.optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, fused=fused or None)
        warmup = max(1, t.warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warmup))
        self.engine = self._build("rollout engine", cfg.rollout.engine, cfg.rollout.options)
        loggers = cfg.logging.loggers if self.ctx.is_main else []  # rank 0 writes the run's record
        self.loggers = [self._build("logger", n, cfg.logging._options[n]) for n in loggers]

    def setup_distributed(self) -> torch.device:
        """This process's device; under torchrun, check the config for N ranks, join the process
        group, and take rank 0's run directory."""
        cfg, t = self.config, self.config.trainer
        world = distributed.env_world()[1]
        try:
            device = distributed.resolve_device(t.device)
            multi_process = plugins.lookup("sharding strategy", cfg.sharding.strategy).multi_process
            if t.micro_batch_tokens and multi_process:  # ranks would run different numbers of passes
                raise ConfigError(
                    f"trainer.micro_batch_tokens works with single-process strategies; sharding strategy "
                    f"'{cfg.sharding.strategy}' runs collectives in every pass. Use trainer.micro_batch_size."
                )
            if world > 1:
                if not multi_process:
                    raise ConfigError(
                        f"sharding.strategy '{cfg.sharding.strategy}' trains on one process, but torchrun started "
                        f"{world} (WORLD_SIZE={world}): their models would drift apart. Set sharding.strategy=fsdp, "
                        "or run without torchrun."
                    )
                distributed.check_divisible(t.prompts_per_step, t.mini_batch_size, world)
        except (ValueError, plugins.PluginError) as e:
            raise ConfigError(str(e)) from None
        distributed.setup(device)
        self.run_dir = Path(distributed.broadcast_object(str(self.run_dir)))
        return device

    def _build(self, kind: str, name: str, options):
        cls = plugins.lookup(kind, name)
        with stage_errors(f"{kind} '{name}'", "setup"):
            return cls(options, self.ctx)

    def stateful_components(self) -> dict:
        """Components whose state goes into checkpoints (they define state_dict/load_state_dict)."""
        found = {
            "algorithm": self.algorithm,
            "shaping": self.shaping,
            **{f"reward/{rc.label}": fn for rc, fn in self.rewards},
        }
        return {k: v for k, v in found.items() if hasattr(v, "state_dict") and hasattr(v, "load_state_dict")}

    # -- the loop ---------------------------------------------------------------------------

    def train(self) -> dict[str, float]:
        t = self.config.trainer
        self.setup()
        if t.resume:
            self.resume()
        for logger in self.loggers:
            logger.open(t.steps, self.start_step)
        self.pm.hook.on_train_start(trainer=self)
        metrics: dict[str, float] = {}
        try:
            with self.catch_signals():
                for step in range(self.start_step + 1, t.steps + 1):
                    metrics = self.step(step)
                    self.agree_on_stop()
                    if self.stop_signal or step == t.steps or (t.save_every and step % t.save_every == 0):
                        path = self.save(step)
                    if self.stop_signal:
                        code = 143 if self.stop_signal == "SIGTERM" else 130
                        raise Interrupted(
                            f"stopped by {self.stop_signal} after step {step}; checkpoint {path}. "
                            f"Continue with: hybridrl train CONFIG --resume trainer.run_dir={self.run_dir}",
                            code,
                        )
        finally:
            self.pm.hook.on_train_end(trainer=self, metrics=metrics)
            for logger in self.loggers:
                logger.close()
            for _, fn in self.rewards:
                fn.close()
            self.engine.close()
            distributed.teardown()
        return metrics

    def agree_on_stop(self) -> None:
        """A signal seen by one rank stops every rank after the same step (checkpoints are collective)."""
        if distributed.world_size() > 1:
            seen = [s for s in distributed.all_gather_objects(self.stop_signal) if s]
            self.stop_signal = self.stop_signal or (seen[0] if seen else None)

    def save(self, step: int) -> Path:
        path = ckpt.save_checkpoint(self, step)
        if self.ctx.is_main:
            ckpt.rotate(self.run_dir, self.config.trainer.keep_last)
        distributed.barrier()
        self.pm.hook.on_checkpoint(trainer=self, step=step, path=path)
        return path

    def resume(self) -> None:
        """Load the newest complete checkpoint of run_dir and continue after its step."""
        main = self.ctx.is_main
        if main:
            ckpt.clean_partial(self.run_dir)
        distributed.barrier()
        path = ckpt.latest_checkpoint(self.run_dir)
        if path is None:
            if main:
                print(f"no checkpoint in {self.run_dir}: starting at step 1", flush=True)
            return
        self.start_step = ckpt.load_checkpoint(self, path)
        for name in ("metrics.jsonl", "samples.jsonl"):  # drop what the interrupted run logged after it
            if main:
                ckpt.truncate_jsonl(self.run_dir / name, self.start_step)
        with stage_errors(f"rollout engine '{self.config.rollout.engine}'", "update_weights"):
            self.engine.update_weights(self.strategy.full_tensors(self.policy))
        if main:
            print(f"resumed from {path} (step {self.start_step})", flush=True)

    @contextlib.contextmanager
    def catch_signals(self):
        """First Ctrl-C/SIGTERM: finish the step, checkpoint, stop. A second Ctrl-C stops at once."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            name = signal.Signals(signum).name
            if self.stop_signal and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.stop_signal = name
            if distributed.is_main():
                print(
                    f"\n{name}: finishing this step, then saving a checkpoint (Ctrl-C again to stop at once "
                    "without saving).",
                    file=sys.stderr,
                    flush=True,
                )

        previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def nonfinite(self, step: int, what: str) -> None:
        """Abort with a clear message, or (trainer.on_nonfinite=skip) warn and let the caller skip."""
        if self.config.trainer.on_nonfinite == "abort":
            last = ckpt.latest_checkpoint(self.run_dir)
            kept = f"the last checkpoint ({last}) is intact" if last else "no checkpoint was written yet"
            raise NonFiniteError(
                f"step {step}: {what}. The run stops; {kept}. Set trainer.on_nonfinite=skip to skip such "
                "updates instead."
            )
        if distributed.is_main():
            print(f"warning: step {step}: {what}; skipping the update.", file=sys.stderr, flush=True)

    def step(self, step: int) -> dict[str, float]:
        cfg, t, r = self.config, self.config.trainer, self.config.rollout
        timer = Timer(self.ctx.device)
        metrics: dict[str, float] = {}
        engine = f"rollout engine '{r.engine}'"

        sampling = SamplingParams(
            n=r.n,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_tokens=r.max_tokens,
            stop=r.stop,
            seed=distributed.rollout_seed(t.seed, step),
            ignore_eos=r.ignore_eos,
        )
        with timer("rollout"), stage_errors(engine, "generate"):
            self.engine.wake_up()
        rounds, round_metrics = [], defaultdict(list)
        share = t.prompts_per_step // distributed.world_size()  # groups each rank trains on
        for round_ in range(1 + r.refill_rounds):
            with timer("rollout"):
                rounds.append(self.rollout_round(round_, replace(sampling, seed=sampling.seed + 10_000_019 * round_)))
            with timer("reward"):
                for k, v in self.score(rounds[-1]).items():  # each round is scored as it comes
                    round_metrics[k].append(v)
                rollout = Batch.cat(rounds, self.tokenizer.pad_token_id) if round_ else rounds[0]
                batch = self.algorithm.filter_batch(rollout)  # all rounds: its metrics cover them all
            if round_ == r.refill_rounds or distributed.all_ranks(batch.groups() >= share):
                break  # every rank kept its share of groups (always, when the algorithm drops none)
        metrics |= {k: sum(v) / len(v) for k, v in round_metrics.items()}  # rounds are the same size
        if len(rounds) > 1:  # the statistics of all the rounds' responses together
            metrics |= self.reward_stats(rollout)
            batch = first_groups(batch, share)
        metrics["rollout/rounds"] = len(rounds)
        with stage_errors(engine, "sleep"):
            self.engine.sleep()
        # ranks take the same branches: the update and the sync are collective under torchrun
        bad = distributed.any_rank(len(batch) > 0 and not torch.isfinite(batch["scores"]).all())
        skip = bad or distributed.all_ranks(len(batch) == 0)
        if bad:
            self.nonfinite(step, "the combined reward is NaN/Inf")
        trained = len(batch)
        if not skip:
            batch = even_out(batch, rollout).to(self.ctx.device)
            with timer("logprobs"):
                metrics |= self.compute_logprobs(batch)
            with timer("advantages"):
                metrics |= self.algorithm.compute_advantages(batch)
            if distributed.any_rank(not torch.isfinite(batch["advantages"]).all()):
                self.nonfinite(step, f"the advantages of algorithm '{cfg.algorithm.name}' are NaN/Inf")
                skip = True
        if not skip:
            with timer("update"):
                metrics |= self.update(batch, step)
        # also after a skipped update: an engine may have released its weights in sleep()
        with timer("sync"), stage_errors(engine, "update_weights"):
            self.engine.update_weights(self.strategy.full_tensors(self.policy))
        metrics["batch/trained_fraction"] = trained / len(rollout) if not skip else 0.0

        metrics |= batch_metrics(rollout if skip else batch, timer.times["rollout"], rollout)
        metrics |= {f"timing/{k}": v for k, v in timer.times.items()}
        metrics["timing/step"] = sum(timer.times.values())
        if not skip:
            metrics |= update_throughput(self.policy, batch, t.epochs, timer.times["update"], self.ctx.device)
        metrics = reduce_metrics(metrics)  # one value per metric over all ranks
        self.pm.hook.on_step_end(trainer=self, step=step, metrics=metrics, batch=rollout if skip else batch)
        samples = None
        if t.sample_every and step % t.sample_every == 0:
            mine = sample_rows(rollout if skip else drop_padding(batch), [rc.label for rc, _ in self.rewards])
            samples = distributed.gather_lists(mine)  # every rank's, on rank 0
        for logger in self.loggers:
            logger.log(step, metrics)
            if samples is not None:
                logger.log_samples(step, samples)
        return metrics

    # -- stages -----------------------------------------------------------------------------

    def rollout_round(self, round_: int, sampling: SamplingParams) -> Batch:
        """Draw the step's prompts (``trainer.prompts_per_step``, this rank's share of them) and
        generate ``rollout.n`` responses to each: the rollout batch, text columns included."""
        cfg, r = self.config, self.config.rollout
        # every rank draws the same prompts and keeps its slice: a prompt's n samples stay together
        rows = distributed.my_share([self.data[i] for i in self.prompts.take(cfg.trainer.prompts_per_step)])
        prompt_ids, prompt_texts = zip(*(encode_prompt(row, cfg.data, self.tokenizer) for row in rows))
        with stage_errors(f"rollout engine '{r.engine}'", "generate"):
            out = self.engine.generate(list(prompt_ids), sampling)
        rollout = Batch.from_rollout(list(prompt_ids), out, r.n, self.tokenizer.pad_token_id)
        first = (round_ * distributed.world_size() + distributed.rank()) * len(rows)  # unique over ranks and rounds
        rollout["group_ids"] = rollout["group_ids"] + first
        rollout["prompt_text"] = [prompt_texts[i // r.n] for i in range(len(rollout))]
        rollout["response_text"] = self.tokenizer.batch_decode(out.token_ids, skip_special_tokens=True)
        col = cfg.data.answer_column
        rollout["answer"] = [rows[i // r.n].get(col) if col else None for i in range(len(rollout))]
        rollout["metadata"] = [rows[i // r.n].get("metadata") for i in range(len(rollout))]
        rollout["messages"] = [prompt_messages(rows[i // r.n], cfg.data) for i in range(len(rollout))]
        return rollout

    def score(self, batch: Batch) -> dict[str, float]:
        total = torch.zeros(len(batch))
        metrics = {}
        lengths = batch["response_mask"].sum(-1).float()
        for i, (rc, fn) in enumerate(self.rewards):
            component = f"reward '{rc.label}' (function '{rc.function}')"
            with stage_errors(component, "score"), reward_device_errors(component, i, fn, self.ctx.device):
                s = torch.as_tensor(fn.score(batch), dtype=torch.float32).reshape(-1)
            if s.shape[0] != len(batch):
                raise RuntimeError(f"reward '{rc.label}' returned {s.shape[0]} scores for {len(batch)} responses.")
            if not torch.isfinite(s).all():  # the step then aborts or skips, naming this reward first
                bad = int((~torch.isfinite(s)).sum())
                print(f"warning: reward '{rc.label}' returned NaN/Inf for {bad} responses", file=sys.stderr)
            batch[f"reward/{rc.label}"] = s
            every = distributed.all_gather_cat(s) if rc.shaping.active else None  # the same on every rank
            if every is not None and torch.isfinite(every).all():  # NaN/Inf: left to the step's guard
                shaped = self.shaping.apply(rc.label, every, distributed.all_gather_cat(lengths), rc.shaping)
                sizes = distributed.all_gather_cat(torch.tensor([len(s)]))
                start = int(sizes[: distributed.rank()].sum())
                s = shaped[start : start + len(s)]  # this rank's rows, shaped with the whole step's statistics
                metrics[f"reward/{rc.label}/shaped_mean"] = shaped.mean().item()
            total += rc.weight * s
        batch["scores"] = total
        return metrics | self.reward_stats(batch)

    def reward_stats(self, batch: Batch) -> dict[str, float]:
        """Mean, std, min and max of each reward (before shaping) and of the combined score, over
        the responses of every rank."""
        metrics = {}
        for key in [f"reward/{rc.label}" for rc, _ in self.rewards] + ["scores"]:
            every = distributed.all_gather_cat(batch[key])  # the statistics of the whole step, on every rank
            name = "reward" if key == "scores" else key
            metrics |= {
                f"{name}/mean": every.mean().item(),
                f"{name}/std": every.std().item() if len(every) > 1 else 0.0,
                f"{name}/min": every.min().item(),
                f"{name}/max": every.max().item(),
            }
        return metrics

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch) -> dict[str, float]:
        """Old logprobs when the step makes several updates; reference logprobs when needed."""
        metrics = {}
        if not self._on_policy(len(batch)) or self.algorithm.needs_old_logprobs:
            batch["old_logprobs"] = self._forward(self.policy, batch, "policy")
            stats = WeightedStats()
            mask = batch["response_mask"]
            stats.add(mismatch_metrics(batch["rollout_logprobs"], batch["old_logprobs"], mask), float(mask.sum()))
            metrics |= stats.result()
        if self.ref is not None:
            batch["ref_logprobs"] = self._forward(self.ref, batch, "reference model")
        return metrics

    def _forward(self, model, batch: Batch, component: str) -> torch.Tensor:
        t = self.config.trainer
        groups = micro_batches(batch, t.micro_batch_size, t.micro_batch_tokens)
        T = batch["responses"].shape[1]
        device = self.strategy.input_device(model)  # the reference may live elsewhere (sharding.ref_device)
        with self.device_errors(component, model, device), self.strategy.autocast():
            parts = [
                response_logprobs(
                    model, mb.input_ids.to(device), mb.attention_mask.to(device), T, self.config.rollout.temperature
                )[0]
                for mb in (batch.select(g) for g in groups)
            ]
        out = torch.cat(parts).to(self.ctx.device)
        rows = torch.tensor([i for g in groups for i in g], device=out.device)
        return torch.empty_like(out).index_copy_(0, rows, out)  # back in the batch's order

    def device_errors(self, component: str, model, inputs: torch.device):
        """Name the component and the devices when torch finds tensors on different ones."""

        def placement():
            devices = sorted({str(p.device) for p in model.parameters()})
            return {"its parameters": ", ".join(devices), "its inputs": inputs, "the policy": self.ctx.device}

        return distributed.device_errors(
            component,
            placement,
            "State each component's device: trainer.device (policy), sharding.ref_device (reference model), "
            "and each reward model's own device option.",
        )

    def _on_policy(self, batch_size: int) -> bool:
        t = self.config.trainer
        return t.epochs == 1 and mini_batch_rows(t.mini_batch_size, batch_size) >= batch_size

    def update(self, batch: Batch, step: int) -> dict[str, float]:
        """The update stage: the policy, then the models the algorithm trains (a critic), one loop."""
        t = self.config.trainer
        settings = dict(
            seed=t.seed,
            micro_batch_size=t.micro_batch_size,
            micro_batch_tokens=t.micro_batch_tokens,
            on_nonfinite=lambda what: self.nonfinite(step, what),
        )
        metrics = {}
        for trainable in [self.policy_trainable(), *self.algorithm.trained_models()]:
            metrics |= run_update(trainable, batch, step, self.strategy, **settings)
        return metrics

    def policy_trainable(self) -> Trainable:
        t = self.config.trainer
        return Trainable(
            name="actor",
            label=f"policy (algorithm '{self.config.algorithm.name}')",
            model=self.policy,
            optimizer=self.optimizer,
            loss=self.policy_loss,
            aggregation=self.algorithm.loss_aggregation,
            epochs=t.epochs,
            mini_batch_size=t.mini_batch_size,
            max_grad_norm=t.max_grad_norm,
            scheduler=self.scheduler,
        )

    def policy_loss(self, part: Batch):
        """The algorithm's loss of a micro-batch, from the policy's logprobs and entropies."""
        T = part["responses"].shape[1]
        with self.device_errors("policy", self.policy, part.input_ids.device), self.strategy.autocast():
            logprobs, entropy = response_logprobs(
                self.policy,
                part.input_ids,
                part.attention_mask,
                T,
                self.config.rollout.temperature,
                with_entropy=True,
                entropy_grad=self.algorithm.needs_entropy_grad,
            )
        mask = part["response_mask"]
        metrics = {"actor/entropy": F.masked_mean(entropy, mask).detach()}
        if "old_logprobs" not in part:  # one update: the sampling policy is the one being updated
            part["old_logprobs"] = logprobs.detach()
            metrics |= mismatch_metrics(part["rollout_logprobs"], part["old_logprobs"], mask)
        loss, m = self.algorithm.loss(part, logprobs, entropy)
        return loss, metrics | m


# -- helpers --------------------------------------------------------------------------------


class Timer:
    """Seconds per stage; on a GPU each stage ends by waiting for its queued kernels."""

    def __init__(self, device: torch.device | None = None):
        self.times: dict[str, float] = {}
        self.cuda = device is not None and device.type == "cuda"

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start


class PromptOrder:
    """Which row comes next: a seeded permutation per epoch and a position, so it can resume."""

    def __init__(self, size: int, seed: int, shuffle: bool = True):
        if size == 0:
            raise ValueError("data: the prompt source has no rows.")
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch, self.pos = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.size))
        return torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.pos == self.size:
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._permutation()
            out.append(self._order[self.pos])
            self.pos += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._permutation()


def prompt_messages(row: dict, data_cfg) -> list[dict]:
    """The chat messages of a row: the prompt column (text through data.template, or messages)."""
    value = row[data_cfg.prompt_column]
    if isinstance(value, list):  # already chat messages
        messages = list(value)
    else:
        try:
            content = data_cfg.template.format(prompt=value, **row)
        except KeyError as e:
            raise ConfigError(
                f"data.template uses {{{e.args[0]}}}, which rows do not have. Row fields: {', '.join(row)}."
            ) from None
        messages = [{"role": "user", "content": content}]
    if data_cfg.system_prompt and not any(m.get("role") == "system" for m in messages):
        messages = [{"role": "system", "content": data_cfg.system_prompt}] + messages
    return messages


def encode_prompt(row: dict, data_cfg, tokenizer) -> tuple[list[int], str]:
    """Token ids and text of the prompt for a row: template, system prompt, chat template."""
    messages = prompt_messages(row, data_cfg)
    if data_cfg.chat_template:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        text = "\n".join(m["content"] for m in messages)
        ids = tokenizer(text)["input_ids"]
    if len(ids) > data_cfg.max_prompt_tokens:
        raise ConfigError(
            f"A prompt has {len(ids)} tokens, more than data.max_prompt_tokens="
            f"{data_cfg.max_prompt_tokens}. Raise it or shorten the template: {text[:80]!r}..."
        )
    return ids, text


def check_columns(source, cfg: RunConfig) -> None:
    columns = getattr(source, "columns", None) or list(source[0])
    for key in ("prompt_column", "answer_column"):
        col = getattr(cfg.data, key)
        if col is not None and col not in columns:
            raise ConfigError(
                f"data.{key} is '{col}', but the rows have no such field. "
                f"Fields: {', '.join(columns)}. Set data.{key} to one of them."
            )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def pick_device(name: str) -> torch.device:
    """The policy's device for ``trainer.device`` (``cuda:LOCAL_RANK`` under torchrun)."""
    try:
        return distributed.resolve_device(name)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def reward_device_errors(component: str, index: int, fn, policy_device: torch.device):
    """Device errors in a reward's score() name the reward, its device option and the policy's."""
    device = getattr(getattr(fn, "options", None), "device", None)
    placement = {"the reward's device option": device, "the policy (trainer.device)": policy_device}
    if device is not None:
        fix = f"Set rewards[{index}].device (now '{device}') to where its model should run."
    else:
        fix = f"Reward function '{type(fn).__name__}' has no device option: check where it puts its model and inputs."
    return distributed.device_errors(component, placement, fix)
