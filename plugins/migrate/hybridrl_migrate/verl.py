"""verl's PPO trainer config (``python -m verl.trainer.main_ppo``) as a hybridrl config.

verl's settings come nested (data, actor_rollout_ref{model, actor, rollout, ref}, critic,
reward_model, algorithm, trainer) from a YAML file and Hydra overrides; a key the user leaves out
takes verl's default (:data:`verl_keys.DEFAULTS`), so that the result trains what verl would, not
what hybridrl's defaults say. The unit traps (docs/migrating.md):

- ``data.train_batch_size`` counts prompts: ``trainer.prompts_per_step``;
- ``ppo_mini_batch_size`` counts prompts and verl multiplies it by ``rollout.n``;
  ``trainer.mini_batch_size`` counts responses (over all ranks);
- ``ppo_micro_batch_size_per_gpu`` counts responses per GPU: ``trainer.micro_batch_size``
  (per rank);
- ``trainer.total_epochs`` counts passes over the data: ``trainer.steps`` = epochs x
  (rows // train_batch_size), verl's dataloader dropping the last partial batch.
"""

from __future__ import annotations

from typing import Any

from hybridrl.errors import ConfigError
from hybridrl_migrate.common import Source, Translation, check_keys
from hybridrl_migrate.data_files import count_rows, data_section
from hybridrl_migrate.verl_algorithm import VerlAlgorithm, expand
from hybridrl_migrate.verl_keys import DEFAULTS, IGNORED, KNOWN, LOST, MOVED, OPEN, A, M, R

ENGINES = {"vllm": "vllm", "sglang": "sglang", "hf": "hf"}
LOGGERS = {"console": "console", "wandb": "wandb", "tensorboard": "tensorboard", "file": "jsonl"}


def translate(given: dict[str, Any], train_rows: int | None = None, added: frozenset[str] = frozenset()) -> Translation:
    """``given``: verl's settings as dotted keys (YAML flattened, overrides applied);
    ``train_rows``: rows of the training data when known (else counted from local files); ``added``:
    the keys given with Hydra's ``+``, which verl takes even where its config has no such key. A key
    verl does not have is refused (Hydra's struct mode refuses it too)."""
    newer = "; a newer verl's key: give it as +key=value to have it listed, untranslated"
    check_keys(given, KNOWN, OPEN, "verl key", added, newer)
    given = dict(given)
    for new, old in MOVED.items():  # verl 0.9's place wins over the older one
        if new in given:
            given[old] = given.pop(new)
    return VerlTranslation(Source(given, DEFAULTS), train_rows).run()


class VerlTranslation(VerlAlgorithm):
    framework, IGNORED, LOST = "verl", IGNORED, LOST

    def __init__(self, src: Source, train_rows: int | None):
        super().__init__(src)
        self.rows = train_rows

    def run(self) -> Translation:
        g = self.src.get
        self.n = int(g(f"{R}.n"))
        self.world = int(g("trainer.nnodes")) * int(g("trainer.n_gpus_per_node"))
        self.model()
        self.data()
        self.rollout()
        self.rewards()
        self.algorithm()
        self.sharding()
        self.trainer()
        self.evaluation()
        self.logging()
        return self.finish()

    # -- sections ------------------------------------------------------------------------------

    def model(self) -> None:
        g = self.src.get
        self.set("model.path", expand(g(f"{M}.path")))
        self.set("model.trust_remote_code", bool(g(f"{M}.trust_remote_code")))
        # verl keeps float32 master weights (fsdp_config.model_dtype fp32) and computes in bfloat16
        dtype = str(g(f"{A}.fsdp_config.model_dtype"))
        self.set("model.dtype", {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(dtype, dtype))
        if self.src.has(f"{M}.override_config.attn_implementation"):
            self.set("model.attn_implementation", g(f"{M}.override_config.attn_implementation"))
        rank = int(g(f"{M}.lora_rank"))
        if rank > 0:
            self.set(
                "model.lora",
                {"r": rank, "alpha": float(g(f"{M}.lora_alpha")), "target_modules": g(f"{M}.target_modules")},
            )
        else:
            self.src.mark(f"{M}.lora_alpha", f"{M}.target_modules")

    def data(self) -> None:
        g = self.src.get
        files = g("data.train_files")
        files = [expand(f) for f in files] if isinstance(files, list) else expand(files)
        section = data_section(files)
        limit = int(g("data.train_max_samples"))
        if limit > 0:
            section["limit"] = limit
        section |= {
            "prompt_column": g("data.prompt_key"),
            # verl's parquet files (examples/data_preprocess) keep the answer under reward_model
            "answer_column": "reward_model.ground_truth",
            "max_prompt_tokens": int(g("data.max_prompt_length")),
            "shuffle": bool(g("data.shuffle")),
        }
        self.out["data"] = section
        if self.rows is None:
            self.rows = count_rows(files)
        if self.rows is not None and limit > 0:
            self.rows = min(self.rows, limit)
        if g("data.truncation") != "error":
            self.lost("data.truncation", "prompts longer than data.max_prompt_tokens are an error, never cut")
        if g("data.filter_overlong_prompts"):
            self.lost(
                "data.filter_overlong_prompts",
                "longer prompts are an error, not dropped: filter the data beforehand",
            )
        if g("data.reward_fn_key") != "data_source":
            self.lost("data.reward_fn_key", "the python reward passes the row's data_source field")

    def rollout(self) -> None:
        g, src = self.src.get, self.src
        name = g(f"{R}.name")
        engine = ENGINES.get(name, "hf")
        if name is None:
            self.report.add("note", f"{R}.name", "not set (verl requires it): engine 'hf', the built-in one")
        elif name not in ENGINES:
            self.lost(f"{R}.name", "engines: hf, vllm, sglang ('hybridrl plugins' lists them); 'hf' used")
        self.engine = engine
        out = {"engine": engine, "n": self.n}
        if g(f"{R}.do_sample"):
            out["temperature"] = float(g(f"{R}.temperature"))
        else:
            self.lost(f"{R}.do_sample", "greedy decoding cannot train with sampled ratios; sampling kept")
            src.mark(f"{R}.temperature")
        out["top_p"] = float(g(f"{R}.top_p"))
        out["top_k"] = max(0, int(g(f"{R}.top_k")))  # verl's -1 (off) is hybridrl's 0
        out["max_tokens"] = int(g(f"{R}.response_length"))
        src.mark("data.max_response_length")
        if g(f"{R}.ignore_eos"):
            out["ignore_eos"] = True
        gpu, tp, dtype = g(f"{R}.gpu_memory_utilization"), int(g(f"{R}.tensor_model_parallel_size")), g(f"{R}.dtype")
        if engine == "vllm":
            out |= {"gpu_memory_utilization": float(gpu), "tensor_parallel_size": tp, "dtype": dtype}
            out |= self.given_as(
                {
                    f"{R}.enforce_eager": "enforce_eager",
                    f"{R}.max_model_len": "max_model_len",
                    f"{R}.enable_prefix_caching": "prefix_caching",
                }
            )
        elif engine == "sglang":
            out |= {"mem_fraction_static": float(gpu), "tp_size": tp, "dtype": dtype}
            out |= self.given_as({f"{R}.max_model_len": "context_length"})
        elif tp > 1 and src.has(f"{R}.tensor_model_parallel_size"):
            self.lost(f"{R}.tensor_model_parallel_size", "the hf engine runs on one device")
        kwargs = {}
        for key in ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill"):
            if engine == "vllm" and src.has(f"{R}.{key}"):
                kwargs[key] = g(f"{R}.{key}")
        if engine in ("vllm", "sglang"):
            extra = {
                k.removeprefix(f"{R}.engine_kwargs.{engine}."): v
                for k, v in src.given.items()
                if k.startswith(f"{R}.engine_kwargs.{engine}.")
            }
            src.mark(f"{R}.engine_kwargs.{engine}")
            kwargs |= extra
            bucket = f"{R}.checkpoint_engine.update_weights_bucket_megabytes"
            if src.has(bucket):
                out["update_bucket_mb"] = float(g(bucket))
        if kwargs:
            out["engine_kwargs"] = kwargs
        if g(f"{R}.multi_turn.enable"):
            self.lost(f"{R}.multi_turn.enable", "multi-turn rollouts: set up rollout.agent by hand (docs/agents.md)")
        self.out["rollout"] = out

    def given_as(self, names: dict[str, str]) -> dict:
        """The settings the user gave among ``names`` (verl key: hybridrl key)."""
        given = {ours: self.src.get(key) for key, ours in names.items() if self.src.has(key)}
        return {k: v for k, v in given.items() if v is not None}

    def sharding(self) -> None:
        g = self.src.get
        strategy = g(f"{A}.strategy")
        if strategy not in ("fsdp", "fsdp2"):
            self.lost(f"{A}.strategy", "sharding strategies: single, fsdp (FSDP2); fsdp used")
        params, optimizer = bool(g(f"{A}.fsdp_config.param_offload")), bool(g(f"{A}.fsdp_config.optimizer_offload"))
        offload = params or optimizer
        out: dict[str, Any] = {}
        if self.world > 1:
            out["strategy"] = "fsdp"
            if not g(f"{A}.fsdp_config.reshard_after_forward"):
                out["mode"] = "shard_grad_op"
            size = int(g(f"{A}.fsdp_config.fsdp_size"))
            if 0 < size < self.world:
                out |= {"mode": "hybrid_shard", "shard_group_size": size}
            if offload:
                out["offload"] = True
            nodes, per_node = int(g("trainer.nnodes")), int(g("trainer.n_gpus_per_node"))
            launch = f"torchrun --nproc-per-node {per_node}" + (f" --nnodes {nodes} (and a rendezvous)" * (nodes > 1))
            self.report.add(
                "note",
                "trainer.n_gpus_per_node / trainer.nnodes",
                f"{self.world} GPUs: start it with '{launch} -m hybridrl.cli train CONFIG.yaml' "
                "(docs/distributed.md); the engine runs on every rank",
                {"n_gpus_per_node": per_node, "nnodes": nodes},
            )
        else:
            out["strategy"] = "single"
            self.src.mark(f"{A}.fsdp_config.reshard_after_forward", f"{A}.fsdp_config.fsdp_size")
            if offload:
                self.lost(f"{A}.fsdp_config.param_offload", "CPU offload needs sharding.strategy fsdp (torchrun)")
        compute = str(g(f"{A}.fsdp_config.dtype"))
        out["mixed_precision"] = "off" if compute in ("fp32", "float32") else "bf16"
        if compute in ("fp16", "float16"):
            self.lost(f"{A}.fsdp_config.dtype", "float16 compute is not available; bfloat16 used")
        if self.out["model"]["dtype"] != "float32":
            self.precision(f"{A}.fsdp_config.model_dtype", self.out["model"]["dtype"])
        elif out["mixed_precision"] == "bf16":
            self.precision(f"{A}.fsdp_config.dtype", "bfloat16")
        out["activation_checkpointing"] = bool(g(f"{M}.enable_gradient_checkpointing"))
        self.out["sharding"] = out

    def trainer(self) -> None:
        g, src = self.src.get, self.src
        prompts = int(g("data.train_batch_size"))
        mini = int(g(f"{A}.ppo_mini_batch_size"))
        if prompts % mini:
            raise ConfigError(
                f"data.train_batch_size={prompts} does not divide by {A}.ppo_mini_batch_size={mini} (both count "
                "prompts); verl refuses it too."
            )
        out: dict[str, Any] = {"prompts_per_step": prompts, "mini_batch_size": mini * self.n}
        self.report.add(
            "units",
            "data.train_batch_size",
            f"prompts per step: trainer.prompts_per_step {prompts} ({prompts * self.n} responses at n={self.n})",
            prompts,
        )
        self.report.add(
            "units",
            f"{A}.ppo_mini_batch_size",
            f"prompts, multiplied by rollout.n={self.n} in verl: trainer.mini_batch_size {mini * self.n} responses",
            mini,
        )
        micro = self.micro(A)
        if micro == "tokens":
            out["micro_batch_tokens"] = int(g(f"{A}.ppo_max_token_len_per_gpu"))
            self.report.add(
                "note",
                f"{A}.ppo_max_token_len_per_gpu",
                "use_dynamic_bsz: trainer.micro_batch_tokens, a token budget per forward/backward per rank",
                out["micro_batch_tokens"],
            )
        elif micro:
            out["micro_batch_size"] = micro
        src.mark(f"{A}.ppo_max_token_len_per_gpu")
        out["epochs"] = int(g(f"{A}.ppo_epochs"))
        out["lr"] = float(g(f"{A}.optim.lr"))
        out["weight_decay"] = float(g(f"{A}.optim.weight_decay"))
        clip = g(f"{A}.grad_clip") if src.has(f"{A}.grad_clip") else g(f"{A}.optim.clip_grad", 1.0)
        out["max_grad_norm"] = float(clip)
        src.mark(f"{A}.grad_clip", f"{A}.optim.clip_grad", f"{A}.optim.grad_clip")
        steps = self.steps(prompts)
        if steps:
            out["steps"] = steps
        out |= self.schedule()
        if list(g(f"{A}.optim.betas")) != [0.9, 0.999]:
            self.lost(f"{A}.optim.betas", "AdamW keeps torch's betas (0.9, 0.999)")
        if str(g(f"{A}.optim.optimizer")).lower() != "adamw":
            self.lost(f"{A}.optim.optimizer", "the optimizer is AdamW")
        if g("data.seed") is not None:
            out["seed"] = int(g("data.seed"))
        save = int(g("trainer.save_freq"))
        if save > 0:
            out["save_every"] = save
        else:  # verl saves nothing, not even at the end
            out["save_final"] = False
        keep = g("trainer.max_actor_ckpt_to_keep")
        if keep:
            out["keep_last"] = int(keep)
        elif save > 0:
            self.report.add("note", "trainer.max_actor_ckpt_to_keep", "unset (verl keeps all): keep_last 2", keep)
        self.checkpoint_dir(out)
        device = g("trainer.device")
        if device != "cuda":
            self.lost("trainer.device", "devices: cuda or cpu (trainer.device auto)")
        out["timeout_s"] = float(g("actor_rollout_ref.nccl_timeout"))
        self.out["trainer"] = out

    def schedule(self) -> dict[str, Any]:
        """The actor's learning rate: its warm-up and what follows it, over ``self.schedule_steps``
        (ActorRolloutRefWorker._build_model_optimizer, verl/workers/fsdp_workers.py)."""
        g, out, total = self.src.get, {}, self.schedule_steps
        warmup = g(f"{A}.optim.lr_warmup_steps")
        warmup = -1 if warmup is None else int(warmup)
        ratio = float(g(f"{A}.optim.lr_warmup_steps_ratio"))
        # verl's legacy FSDP worker (the default, trainer.use_legacy_worker_impl auto) takes the ratio for a
        # negative lr_warmup_steps only; its engine workers (FSDPEngine._build_lr_scheduler,
        # verl/workers/engine/fsdp/transformer_impl.py), Megatron's and verl 0.10 (no legacy worker) for 0 too
        legacy = g("trainer.use_legacy_worker_impl") in ("auto", "enable") and g(f"{A}.strategy") in ("fsdp", "fsdp2")
        by_ratio = warmup < 0 or (warmup == 0 and not legacy)
        if warmup == 0 and legacy and ratio > 0:
            other = f"{int(ratio * total)}" if total else f"{ratio} x trainer.steps"
            self.report.add(
                "note",
                f"{A}.optim.lr_warmup_steps",
                f"0: no warm-up, as verl's default (legacy) FSDP worker takes lr_warmup_steps_ratio for a negative "
                f"value only; its engine workers (trainer.use_legacy_worker_impl: disable, verl 0.10) take it for 0 "
                f"too: for those set trainer.warmup_steps: {other}",
                0,
            )
        if warmup > 0:
            out |= self.warmup(f"{A}.optim.lr_warmup_steps", warmup)
        elif by_ratio and ratio > 0 and not total:
            self.lost(f"{A}.optim.lr_warmup_steps_ratio", "a ratio of unknown steps: set trainer.warmup_steps")
        elif by_ratio and int(ratio * (total or 0)):  # verl rounds down
            out |= self.warmup(f"{A}.optim.lr_warmup_steps_ratio", int(ratio * total))
        schedule = g(f"{A}.optim.warmup_style") or g(f"{A}.optim.lr_scheduler_type")
        if schedule == "cosine":  # verl's cosine: down to min_lr_ratio x lr, num_cycles 0.5 (half a cosine)
            out["lr_schedule"], out["min_lr_ratio"] = "cosine", float(g(f"{A}.optim.min_lr_ratio", 0.0) or 0.0)
            if float(g(f"{A}.optim.num_cycles", 0.5)) != 0.5:
                self.lost(f"{A}.optim.num_cycles", "the cosine decays once, over half a period")
        elif schedule != "constant":
            self.lost(
                f"{A}.optim.lr_scheduler_type", "the learning rate is constant, or decays linearly or by a cosine"
            )
        return out

    def steps(self, prompts: int) -> int | None:
        """verl's steps: total_training_steps, else total_epochs x the full batches of the data, and never
        past the last epoch (RayPPOTrainer.fit loops over the epochs; RayPPOTrainer._create_dataloader drops
        the last partial batch, drop_last=True, and asserts a batch is left); ``self.schedule_steps``: those
        verl's learning-rate schedule spans (total_training_steps where given)."""
        g = self.src.get
        total, epochs = g("trainer.total_training_steps"), int(g("trainer.total_epochs"))
        self.schedule_steps = int(total) if total else None
        if self.rows is None:
            if total:
                return int(total)
            self.report.add(
                "lost",
                "trainer.total_epochs",
                f"the size of the training data is not known (give --train-rows N, or run where the files are): "
                f"set trainer.steps to {epochs} x (rows // {prompts})",
                epochs,
            )
            return None
        batches = self.rows // prompts
        if not batches:
            raise ConfigError(
                f"data.train_batch_size={prompts} is more than the {self.rows} rows of the training data: verl drops "
                f"the last partial batch and refuses an empty loader ('Train dataloader is empty!'). Lower "
                f"data.train_batch_size to {self.rows} or less, or give more rows (or their count: --train-rows N)."
            )
        if epochs < 1:
            raise ConfigError(f"trainer.total_epochs={epochs} trains no step in verl; set it to 1 or more.")
        steps = min(int(total or epochs * batches), epochs * batches)
        self.schedule_steps = self.schedule_steps or steps
        if not total or steps < int(total):
            self.report.add(
                "units",
                "trainer.total_epochs",
                f"epochs over {self.rows} rows, {batches} steps each (verl drops the last partial batch): "
                f"trainer.steps {steps}" + (f", before total_training_steps {total}" if total else ""),
                epochs,
            )
        return steps

    def checkpoint_dir(self, out: dict) -> None:
        g, src = self.src.get, self.src
        if src.has("trainer.default_local_dir"):
            out["run_dir"] = expand(g("trainer.default_local_dir"))
            if g("trainer.resume_mode") == "auto":
                out["resume"] = True
        elif g("trainer.resume_mode") == "auto":
            self.report.add(
                "note",
                "trainer.resume_mode",
                "verl resumes from checkpoints/<project>/<experiment> by itself; hybridrl resumes with "
                "trainer.run_dir set and --resume (or trainer.resume: true)",
                "auto",
            )
        src.mark("trainer.resume_mode")

    def evaluation(self) -> None:
        """verl's validation (val_files every test_freq steps, before training, at the last step) as
        a held-out set of data.eval, scored with the run's rewards."""
        g, src = self.src.get, self.src
        freq, before = int(g("trainer.test_freq")), bool(g("trainer.val_before_train"))
        if not src.has("data.val_files"):
            if freq > 0:
                self.lost("trainer.test_freq", "data.val_files is not given: nothing to evaluate")
            return
        files = g("data.val_files")
        files = [expand(f) for f in files] if isinstance(files, list) else expand(files)
        s = {"name": "val", **data_section(files)}
        if int(g("data.val_max_samples", -1)) > 0:
            s["limit"] = int(g("data.val_max_samples"))
        k = f"{R}.val_kwargs"
        if g(f"{k}.do_sample", False):  # verl validates greedily unless do_sample
            s |= {"greedy": False, "n": int(g(f"{k}.n", 1)), "temperature": float(g(f"{k}.temperature", 1.0))}
            s |= {"top_p": float(g(f"{k}.top_p", 1.0)), "top_k": max(0, int(g(f"{k}.top_k", -1)))}
        self.out["data"]["eval"] = [s]
        self.out["trainer"] |= {"eval_every": max(freq, 0), "eval_before_train": before, "eval_after_train": freq > 0}
        self.report.add(
            "note",
            "data.val_files",
            "evaluated as data.eval set 'val' with the run's rewards (eval/val/... metrics, split by data_source as "
            "verl's val/test_score/<data_source>)",
            files,
        )

    def logging(self) -> None:
        g = self.src.get
        given = g("trainer.logger")
        names = [given] if isinstance(given, str) else list(given)
        loggers = [LOGGERS[n] for n in names if n in LOGGERS]
        for other in [n for n in names if n not in LOGGERS]:
            self.report.add(
                "lost", "trainer.logger", "loggers: console, wandb, tensorboard and file (jsonl, always on)", other
            )
        out: dict[str, Any] = {"loggers": [*dict.fromkeys([*loggers, "jsonl"])]}
        if "wandb" in loggers:
            out["wandb"] = {"project": g("trainer.project_name"), "name": g("trainer.experiment_name")}
        else:
            self.src.mark("trainer.project_name", "trainer.experiment_name")
        self.out["logging"] = out
