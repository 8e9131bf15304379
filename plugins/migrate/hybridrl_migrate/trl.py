"""TRL's ``GRPOConfig`` (and the ``trl grpo`` script's arguments) as a hybridrl config.

The unit traps (docs/migrating.md): TRL's batch sizes count completions per process;
``num_generations`` is ``rollout.n``; one generation batch (``per_device_train_batch_size`` x
processes x ``steps_per_generation``, which defaults to ``gradient_accumulation_steps``) is one
hybridrl step, whose prompts are that many completions / ``num_generations``; an optimizer step
takes ``per_device_train_batch_size`` x processes x ``gradient_accumulation_steps`` completions
(``trainer.mini_batch_size``); ``num_iterations`` passes over each generation batch are
``trainer.epochs``; ``max_steps``, ``warmup_steps``, ``save_steps`` and ``logging_steps`` count
optimizer steps, ``spg`` x ``num_iterations`` / ``gradient_accumulation_steps`` of them per
hybridrl step.
"""

from __future__ import annotations

import math
from typing import Any

from hybridrl.errors import ConfigError
from hybridrl_migrate.common import Source, Translation, check_keys
from hybridrl_migrate.data_files import count_rows, data_section
from hybridrl_migrate.trl_algorithm import TrlAlgorithm
from hybridrl_migrate.trl_keys import DEFAULTS, IGNORED, KNOWN, LOST

ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf")
#: placeholders where TRL's settings do not say (the model and data are GRPOTrainer's arguments)
MODEL, DATASET = "MODEL_PATH", "DATASET"


def translate(given: dict[str, Any], train_rows: int | None = None, world_size: int | None = None) -> Translation:
    """``given``: GRPOConfig's arguments by name (mappings such as model_init_kwargs as mappings);
    ``world_size``: processes of the accelerate launch (default 1). A name TRL does not take is
    refused (its parser refuses it too)."""
    check_keys(given, KNOWN, (), "TRL argument")
    return TrlTranslation(Source(given, DEFAULTS), train_rows, world_size).run()


class TrlTranslation(TrlAlgorithm):
    framework, IGNORED, LOST = "trl", IGNORED, LOST

    def __init__(self, src: Source, train_rows: int | None, world_size: int | None):
        super().__init__(src)
        self.rows = train_rows
        self.world = world_size or 1
        self.world_given = world_size is not None

    def run(self) -> Translation:
        self.batches()
        self.model()
        self.data()
        self.rollout()
        self.rewards()
        self.algorithm()
        self.trainer()
        self.logging()
        return self.finish()

    def batches(self) -> None:
        """Generation batch, prompts per step, optimizer batch: TRL's GRPOConfig.__post_init__."""
        g = self.src.get
        per_device, accum = int(g("per_device_train_batch_size")), int(g("gradient_accumulation_steps"))
        n, gen, spg = int(g("num_generations")), g("generation_batch_size"), g("steps_per_generation")
        if gen is not None and spg is not None:
            raise ConfigError("generation_batch_size and steps_per_generation are both set; TRL refuses that too.")
        if gen is None:
            spg = int(spg or accum)
            gen = per_device * self.world * spg
        else:
            gen, spg = int(gen), int(gen) // (per_device * self.world)
        if gen % n:
            raise ConfigError(f"a generation batch of {gen} completions does not divide by num_generations={n}.")
        self.n, self.accum, self.spg, self.per_device = n, accum, spg, per_device
        self.iterations = int(g("num_iterations"))
        self.prompts, self.gen = gen // n, gen
        self.optimizer_batch = per_device * self.world * accum
        # optimizer steps per hybridrl step (one generation batch, num_iterations passes)
        self.per_step = spg * self.iterations / accum
        if not self.world_given:
            self.report.add(
                "note",
                "--world-size",
                "not given: 1 process. TRL's batch sizes are per process: give the accelerate launch's "
                "num_processes as --world-size",
            )

    def model(self) -> None:
        g, src = self.src.get, self.src
        init = dict(g("model_init_kwargs") or {})
        path = src.given.get("model") or g("model_name_or_path")
        src.mark("model")
        if not path:
            self.report.add("note", "model_name_or_path", f"not given (GRPOTrainer's model): set model.path ({MODEL})")
        self.set("model.path", path or MODEL)
        old = None if src.has("dtype") else src.given.get("torch_dtype")  # ModelConfig's name before dtype
        dtype = init.get("dtype") or init.get("torch_dtype") or old or g("dtype")
        src.mark("torch_dtype")
        if dtype in ("float32", "bfloat16", "float16"):
            self.set("model.dtype", dtype)
            if dtype != "float32":
                self.report.add(
                    "note",
                    "dtype",
                    f"TRL trains the {dtype} weights themselves; hybridrl keeps float32 master weights and computes "
                    f"in {dtype}",
                    dtype,
                )
        else:
            self.report.add(
                "lost",
                "dtype",
                "'auto' trains the checkpoint's dtype as it is; hybridrl keeps float32 master weights "
                "(model.dtype float32 here, bfloat16 compute under sharding.mixed_precision)",
                dtype,
            )
            self.set("model.dtype", "float32")
        self.set("model.trust_remote_code", bool(init.get("trust_remote_code", g("trust_remote_code"))))
        attn = init.get("attn_implementation") or g("attn_implementation")
        if attn:
            self.set("model.attn_implementation", attn)
        self.set("model.dropout", not g("disable_dropout"))
        if not g("disable_dropout"):
            self.report.add(
                "note",
                "disable_dropout",
                "false (TRL's default now): the model's dropout stays on, as model.dropout: true; most LLMs have "
                "none, and with it the importance ratios are noise (docs/config.md)",
                False,
            )
        if g("use_peft"):
            lora = {"r": int(g("lora_r")), "alpha": float(g("lora_alpha")), "dropout": float(g("lora_dropout"))}
            lora["target_modules"] = g("lora_target_modules") or "all-linear"
            self.set("model.lora", lora)
            if not src.has("lora_target_modules"):
                self.report.add("note", "lora_target_modules", "unset (peft's per-model default): all-linear used")
        else:
            src.mark("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")
        bf16 = g("bf16")
        self.out["sharding"] = {
            "strategy": "fsdp" if self.world > 1 else "single",
            "mixed_precision": "off" if bf16 is False else "bf16",
            "activation_checkpointing": bool(g("gradient_checkpointing")),
        }
        if self.out["model"]["dtype"] != "float32":
            self.precision("dtype", self.out["model"]["dtype"])
        elif bf16 is not False:
            self.precision("bf16", "bfloat16")
        if self.world > 1:
            self.report.add(
                "note",
                "--world-size",
                f"{self.world} processes: start it with 'torchrun --nproc-per-node {self.world} -m hybridrl.cli "
                "train CONFIG.yaml' (accelerate's DeepSpeed/FSDP becomes sharding.strategy fsdp)",
                self.world,
            )

    def data(self) -> None:
        g, src = self.src.get, self.src
        name = src.given.get("train_dataset") or src.given.get("dataset") or g("dataset_name")
        src.mark("train_dataset", "dataset")
        if not name:
            self.report.add(
                "note", "dataset_name", f"not given (GRPOTrainer's train_dataset): set data.path ({DATASET})"
            )
        section = data_section(name or DATASET)
        if g("dataset_config"):
            section["name"] = g("dataset_config")
        section["split"] = g("dataset_train_split")
        section["prompt_column"] = "prompt"  # TRL's datasets hold a 'prompt' column
        section["answer_column"] = None
        section["shuffle"] = bool(g("shuffle_dataset"))
        if g("max_prompt_length"):
            section["max_prompt_tokens"] = int(g("max_prompt_length"))
            self.report.add(
                "note",
                "max_prompt_length",
                "TRL cut longer prompts on the left; data.max_prompt_tokens refuses them",
                g("max_prompt_length"),
            )
        self.report.add(
            "note",
            "prompt",
            "TRL applies the chat template to conversational prompts (lists of messages) only: for plain-text "
            "prompts set data.chat_template: false",
        )
        self.out["data"] = section
        if self.rows is None and name:
            self.rows = count_rows(name)

    def rollout(self) -> None:
        g, src = self.src.get, self.src
        top_k = g("top_k")
        out: dict[str, Any] = {
            "engine": "vllm" if g("use_vllm") else "hf",
            "n": self.n,
            "temperature": float(g("temperature")),
            "top_p": float(g("top_p")),
            "top_k": int(top_k or 0),
            "max_tokens": int(g("max_completion_length")),
        }
        if g("use_vllm"):
            if g("vllm_mode") == "server":
                url = g("vllm_server_base_url") or f"http://{g('vllm_server_host')}:{g('vllm_server_port')}"
                out["base_url"] = url.replace("//0.0.0.0:", "//127.0.0.1:")
                self.report.add(
                    "note",
                    "vllm_mode",
                    "server: hybridrl talks to vLLM's own server (vllm serve --logprobs-mode processed_logprobs, "
                    "with VLLM_SERVER_DEV_MODE=1 to reload weights; docs/rollout_vllm.md), not 'trl vllm-serve'",
                    "server",
                )
                src.mark("vllm_gpu_memory_utilization", "vllm_tensor_parallel_size")
            else:
                out["gpu_memory_utilization"] = float(g("vllm_gpu_memory_utilization"))
                out["tensor_parallel_size"] = int(g("vllm_tensor_parallel_size"))
                src.mark("vllm_server_base_url", "vllm_server_host", "vllm_server_port")
            length = g("vllm_max_model_length") or g("vllm_max_model_len")
            if length:
                out["max_model_len"] = int(length)
            if src.has("vllm_enable_sleep_mode"):
                out["sleep_level"] = 1 if g("vllm_enable_sleep_mode") else 0
        else:
            src.mark("vllm_mode", "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size", "vllm_max_model_length")
            src.mark("vllm_max_model_len", "vllm_server_base_url", "vllm_server_host", "vllm_server_port")
            src.mark("vllm_enable_sleep_mode")
        self.out["rollout"] = out

    def trainer(self) -> None:
        g, src = self.src.get, self.src
        out: dict[str, Any] = {"prompts_per_step": self.prompts}
        self.report.add(
            "units",
            "per_device_train_batch_size x processes x steps_per_generation",
            f"{self.per_device} x {self.world} x {self.spg} = {self.gen} completions per generation batch / "
            f"num_generations {self.n}: trainer.prompts_per_step {self.prompts}",
        )
        if self.spg % self.accum:
            self.report.add(
                "lost",
                "steps_per_generation",
                f"an optimizer step of {self.optimizer_batch} completions straddles generation batches of "
                f"{self.gen}; one optimizer step per generation batch used",
                self.spg,
            )
            out["mini_batch_size"] = self.gen
        else:
            out["mini_batch_size"] = self.optimizer_batch
            self.report.add(
                "units",
                "per_device_train_batch_size x processes x gradient_accumulation_steps",
                f"{self.per_device} x {self.world} x {self.accum}: trainer.mini_batch_size {self.optimizer_batch} "
                "completions per optimizer step",
            )
        out["micro_batch_size"] = self.per_device
        self.report.add(
            "units",
            "per_device_train_batch_size",
            f"completions per forward/backward of each process: trainer.micro_batch_size {self.per_device}",
            self.per_device,
        )
        out["epochs"] = self.iterations
        out["lr"] = float(g("learning_rate"))
        out["weight_decay"] = float(g("weight_decay"))
        out["max_grad_norm"] = float(g("max_grad_norm"))
        out["seed"] = int(g("seed"))
        steps = self.steps()
        if steps:
            out["steps"] = steps
        schedule, kwargs = g("lr_scheduler_type"), g("lr_scheduler_kwargs", None) or {}
        out |= self.warmup_steps(schedule, steps)
        if schedule in ("linear", "cosine", "cosine_with_min_lr"):  # over the run's steps, as TRL's over its updates
            out["lr_schedule"] = "linear" if schedule == "linear" else "cosine"
            out["min_lr_ratio"] = float(kwargs.get("min_lr_rate", 0.0))
            if set(kwargs) - {"num_cycles", "min_lr_rate"} or kwargs.get("num_cycles", 0.5) != 0.5:
                self.lost("lr_scheduler_kwargs", "the decay ends at trainer.min_lr_ratio x lr, after half a cosine")
            elif schedule == "cosine_with_min_lr" and "min_lr_rate" not in kwargs:
                self.lost("lr_scheduler_type", "the decay ends at a share of lr: set trainer.min_lr_ratio")
        elif schedule not in ("constant", "constant_with_warmup"):
            self.lost("lr_scheduler_type", "the learning rate is constant, or decays linearly or by a cosine")
        if g("optim") not in ADAMW:
            self.lost("optim", "the optimizer is AdamW")
        if g("output_dir"):
            out["run_dir"] = g("output_dir")
        strategy = g("save_strategy")
        if strategy == "steps":
            out["save_every"] = max(1, round(float(g("save_steps")) / self.per_step))
        elif strategy == "epoch" and self.rows:
            out["save_every"] = max(1, self.rows // self.prompts)
        else:
            src.mark("save_steps")
        if g("save_total_limit"):
            out["keep_last"] = int(g("save_total_limit"))
        self.out["trainer"] = out
        self.evaluation()

    def warmup_steps(self, schedule: str, steps: int | None) -> dict:
        """transformers' warm-up (TrainingArguments.get_warmup_steps): warmup_steps optimizer steps, a
        ratio of them below 1 (transformers 5; warmup_ratio before), none with the 'constant' schedule
        (get_scheduler builds get_constant_schedule, which ignores them; constant_with_warmup warms up)."""
        g = self.src.get
        given, ratio = float(g("warmup_steps")), float(g("warmup_ratio"))
        key = "warmup_steps" if given or not ratio else "warmup_ratio"
        if 0 < given < 1:
            given, ratio = 0, given
        if schedule == "constant":
            if given or ratio:
                self.report.add(
                    "note",
                    key,
                    "lr_scheduler_type constant has no warm-up in transformers (get_constant_schedule ignores it; "
                    "constant_with_warmup warms up): no warm-up here either",
                    g(key),
                )
            return {}
        if given >= 1:
            return self.warmup(key, math.ceil(int(given) / self.per_step))
        if ratio and steps:
            return self.warmup(key, math.ceil(ratio * steps))
        if ratio:
            self.lost(key, "a ratio of unknown steps: set trainer.warmup_steps")
        return {}

    def evaluation(self) -> None:
        """TRL's evaluation (the test split, every eval_steps optimizer steps, sampled as in training)
        as a held-out set of data.eval, scored with the run's rewards."""
        g, src = self.src.get, self.src
        strategy = g("eval_strategy")
        if strategy == "no":
            src.mark("eval_steps", "eval_on_start", "dataset_test_split", "num_generations_eval")
            return
        data = self.out["data"]
        s = {"name": "test", "source": "hf", "path": data["path"], "split": g("dataset_test_split")}
        if "name" in data:  # in data.eval, 'name' is the set's
            self.report.add(
                "note", "dataset_config", "data.eval[0] reads the dataset's default configuration", data["name"]
            )
        n = int(g("num_generations_eval") or self.n)
        rollout = self.out["rollout"]
        s |= {"greedy": False, "n": n, "temperature": rollout["temperature"], "top_p": rollout["top_p"]}
        s["top_k"] = rollout["top_k"]
        every = g("eval_steps") or g("logging_steps")  # transformers: eval_steps defaults to logging_steps
        trainer = self.out["trainer"]
        if strategy == "steps":
            trainer["eval_every"] = max(1, round(float(every) / self.per_step))
        elif strategy == "epoch" and self.rows:
            trainer["eval_every"] = max(1, self.rows // self.prompts)
        else:
            self.lost("eval_strategy", "evaluation every epoch of unknown steps: set trainer.eval_every")
        trainer["eval_before_train"] = bool(g("eval_on_start"))
        data["eval"] = [s]
        self.report.add(
            "note",
            "eval_strategy",
            f"the '{s['split']}' split is evaluated as data.eval set 'test' with the run's rewards",
            strategy,
        )

    def steps(self) -> int | None:
        """Optimizer steps as hybridrl steps; refused where the data holds no whole generation batch,
        which TRL's RepeatSampler drops (trl/trainer/utils.py), training nothing."""
        g = self.src.get
        max_steps, epochs = int(g("max_steps")), float(g("num_train_epochs"))
        if self.rows is not None and self.rows < self.prompts:
            raise ConfigError(
                f"a generation batch takes {self.prompts} prompts, more than the {self.rows} rows of the training "
                "data: TRL drops the incomplete batch and trains nothing. Lower per_device_train_batch_size or "
                "steps_per_generation, or give more rows (or their count: --train-rows N)."
            )
        if max_steps > 0:
            steps = math.ceil(max_steps / self.per_step)
            self.report.add(
                "units",
                "max_steps",
                f"optimizer steps, {self.per_step:g} per generation batch: trainer.steps {steps}",
                max_steps,
            )
            return steps
        if self.rows is not None:
            steps = math.ceil(epochs * (self.rows // self.prompts))
            self.report.add(
                "units",
                "num_train_epochs",
                f"epochs over {self.rows} rows of {self.prompts} prompts per step: trainer.steps {steps}",
                epochs,
            )
            if not steps:
                raise ConfigError(f"num_train_epochs={epochs:g} trains no step; set it above 0, or set max_steps.")
            return steps
        self.report.add(
            "lost",
            "num_train_epochs",
            f"the size of the training data is not known (give --train-rows N): set trainer.steps to "
            f"{epochs:g} x (rows // {self.prompts})",
            epochs,
        )
        return None

    def logging(self) -> None:
        g = self.src.get
        given = g("report_to")
        names = [given] if isinstance(given, str) else list(given or [])
        loggers = ["console"]
        for name in names:
            if name in ("wandb", "tensorboard"):
                loggers.append(name)
            elif name != "none":
                self.report.add("lost", "report_to", "loggers: console, wandb, tensorboard (and jsonl)", name)
        if given is None:
            self.report.add(
                "note", "report_to", "unset: TRL's default depends on the transformers version; console and jsonl"
            )
        out: dict[str, Any] = {"loggers": [*loggers, "jsonl"]}
        if "wandb" in loggers and g("run_name"):
            out["wandb"] = {"name": g("run_name")}
        else:
            self.src.mark("run_name")
        every = float(g("logging_steps"))
        if every >= 1:
            out["console"] = {"every": max(1, round(every / self.per_step))}
        self.out["logging"] = out
