"""hybridrl import verl|trl: real verl and TRL configs become hybridrl configs that validate, with
their units converted and every setting without an equivalent listed (docs/migrating.md)."""

import copy
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hybridrl_migrate import translate
from hybridrl_migrate.common import apply_items, parse_value

from hybridrl.config import load_config
from hybridrl.errors import ConfigError

FIXTURES = Path(__file__).parent / "fixtures"
GSM8K_TRAIN_ROWS = 7473  # openai/gsm8k's train split, as verl's examples/data_preprocess/gsm8k.py writes it


def quickstart_items() -> list[str]:
    """The key=value items of verl's quickstart command (fixtures/verl_quickstart_ppo.sh)."""
    text = "\n".join(line for line in (FIXTURES / "verl_quickstart_ppo.sh").read_text().splitlines() if line[:1] != "#")
    return [item for item in shlex.split(text.replace("\\\n", " ")) if "=" in item]


def validate(config: dict):
    """load_config on the translation: it must validate as it is."""
    return load_config(data=copy.deepcopy(config))


def notes(t, kind: str) -> dict[str, str]:
    return {n.key: n.why for n in t.report.of(kind)}


# -- verl ----------------------------------------------------------------------------------


def test_verl_quickstart_ppo_translates_with_its_units():
    t = translate("verl", quickstart_items(), train_rows=GSM8K_TRAIN_ROWS)
    cfg = validate(t.config)
    tr, alg = cfg.trainer, cfg.algorithm.options
    assert cfg.algorithm.name == "ppo" and alg.critic and alg.critic_arch == "token_classification"
    assert cfg.rollout.n == 1 and cfg.rollout.engine == "vllm"
    assert tr.prompts_per_step == 256  # data.train_batch_size counts prompts
    assert tr.mini_batch_size == 64  # ppo_mini_batch_size 64 prompts x n=1
    assert tr.micro_batch_size == 4  # per GPU = per rank
    assert tr.steps == 15 * (GSM8K_TRAIN_ROWS // 256) == 435  # epochs x full batches (verl drops the last)
    assert tr.lr == 1e-6 and tr.weight_decay == 0.01  # verl's default weight decay carried, not hybridrl's 0
    assert tr.save_every == 10 and tr.epochs == 1 and tr.max_grad_norm == 1.0
    assert cfg.rollout.max_tokens == 512 and cfg.data.max_prompt_tokens == 512
    assert cfg.rollout.options.gpu_memory_utilization == 0.4 and cfg.rollout.options.tensor_parallel_size == 1
    assert (alg.critic_lr, alg.critic_micro_batch_size, alg.critic_mini_batch_size) == (1e-5, 4, 64)
    assert alg.critic_path == "Qwen/Qwen2.5-0.5B-Instruct" and cfg.model.path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert not alg.use_kl_in_reward and not alg.use_kl_loss
    assert cfg.data.path == os.path.expandvars("$HOME/data/gsm8k/train.parquet")  # as the shell expands it
    assert cfg.data.prompt_column == "prompt" and cfg.data.answer_column == "reward_model.ground_truth"
    assert cfg.rewards[0].function == "answer_match" and cfg.rewards[0].options.pattern.startswith("####")
    assert cfg.sharding.strategy == "single" and cfg.logging.loggers == ["console", "jsonl"]
    # verl's validation: the test file every test_freq steps and at the last step, not before (val_before_train)
    assert cfg.data.eval[0].name == "val" and cfg.data.eval[0].greedy  # verl validates greedily
    assert cfg.data.eval[0].options.path == os.path.expandvars("$HOME/data/gsm8k/test.parquet")
    assert (tr.eval_every, tr.eval_before_train, tr.eval_after_train) == (10, False, True)
    # what has no effect is listed with its reason
    ignored = notes(t, "ignored")
    assert "use_kl_in_reward" in ignored["algorithm.kl_ctrl.kl_coef"]  # current verl applies it only then
    assert "micro_batch" in ignored["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"]
    assert not t.report.of("unknown")


def test_verl_mini_batch_counts_prompts_times_n():
    """The worked example of docs/migrating.md: n=8, 256 prompts, ppo_mini_batch_size 64."""
    t = translate("verl", [*quickstart_items(), "actor_rollout_ref.rollout.n=8"], train_rows=GSM8K_TRAIN_ROWS)
    cfg = validate(t.config)
    assert cfg.trainer.prompts_per_step == 256
    assert cfg.trainer.mini_batch_size == 512  # 64 prompts x 8 responses: 4 optimizer steps per step
    assert cfg.trainer.prompts_per_step * cfg.rollout.n // cfg.trainer.mini_batch_size == 256 // 64
    assert cfg.algorithm.options.critic_mini_batch_size == 512  # the critic's follows the actor's
    assert "trainer.mini_batch_size 512 responses" in notes(t, "units")["actor_rollout_ref.actor.ppo_mini_batch_size"]


def test_verl_grpo_yaml_on_eight_gpus():
    t = translate("verl", [str(FIXTURES / "verl_grpo_gsm8k.yaml")], train_rows=GSM8K_TRAIN_ROWS)
    cfg = validate(t.config)
    alg = cfg.algorithm.options
    assert cfg.algorithm.name == "grpo" and alg.estimator == "grpo" and alg.norm_adv_by_std
    assert alg.kl_coef == 0.001 and alg.kl_kind == "k3"  # use_kl_loss + low_var_kl
    assert (alg.clip_low, alg.clip_high, alg.clip_c, alg.loss_agg_mode) == (0.2, 0.2, 3.0, "token-mean")
    assert cfg.rollout.n == 5 and cfg.rollout.max_tokens == 1024
    assert cfg.trainer.prompts_per_step == 1024 and cfg.trainer.mini_batch_size == 256 * 5
    assert cfg.trainer.micro_batch_size == 40 and cfg.trainer.steps == 15 * (GSM8K_TRAIN_ROWS // 1024)
    assert cfg.trainer.save_every == 20
    assert cfg.rollout.options.tensor_parallel_size == 2 and cfg.rollout.options.gpu_memory_utilization == 0.6
    assert cfg.sharding.strategy == "fsdp" and cfg.sharding.options.activation_checkpointing
    assert "torchrun --nproc-per-node 8" in notes(t, "note")["trainer.n_gpus_per_node / trainer.nnodes"]
    assert cfg.logging.loggers == ["console", "wandb", "jsonl"]
    assert cfg.logging._options["wandb"].project == "verl_grpo_example_gsm8k"
    assert cfg.logging._options["wandb"].name == "qwen2_7b_function_rm"
    lost = notes(t, "lost")
    assert "filter the data" in lost["data.filter_overlong_prompts"]
    assert (cfg.trainer.eval_every, cfg.trainer.eval_before_train) == (5, True)  # val_before_train's default
    assert "actor_rollout_ref.ref.fsdp_config.param_offload" in notes(t, "ignored")
    assert not t.report.of("unknown")


def test_verl_unsupported_and_added_keys_are_listed_not_dropped():
    items = [
        *quickstart_items(),
        "+trainer.mystery=x",  # Hydra's '+' adds a key verl's config lacks: verl takes it, so it is listed
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "trainer.critic_warmup=0",  # at verl's default: nothing to say
    ]
    t = translate("verl", items, train_rows=GSM8K_TRAIN_ROWS)
    assert {n.key: n.value for n in t.report.of("unknown")} == {"trainer.mystery": "x"}
    assert "Ulysses" in notes(t, "lost")["actor_rollout_ref.actor.ulysses_sequence_parallel_size"]
    assert "trainer.critic_warmup" in notes(t, "ignored")
    validate(t.config)
    # the YAML written says it too, on top
    assert "# Not translated (no rule here reads these):" in t.yaml() and "trainer.mystery=x" in t.yaml()


def test_verl_09_reward_section_and_overrides_translate(tmp_path):
    """verl 0.9 moved the reward function under ``reward.``: the side-by-side benchmark's own verl
    command (benchmarks/gpu_vs_verl.py) translates with its reward file, attention and file logger."""
    reward = tmp_path / "score.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    items = [
        *quickstart_items(),
        f"reward.custom_reward_function.path={reward}",
        "reward.custom_reward_function.name=compute_score",
        "reward.reward_manager.name=naive",
        "reward.num_workers=8",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "trainer.logger=[console,file]",
    ]
    t = translate("verl", items, train_rows=GSM8K_TRAIN_ROWS)
    assert t.config["rewards"] == [{"function": "python", "path": str(reward), "function_name": "compute_score"}]
    assert t.config["model"]["attn_implementation"] == "sdpa"
    assert t.config["logging"]["loggers"] == ["console", "jsonl"]
    assert not t.report.of("unknown")
    assert "reward.num_workers" in notes(t, "ignored")
    validate(t.config)


def test_verl_steps_from_total_training_steps_or_said_unknown():
    t = translate("verl", quickstart_items())  # the parquet file is not on this machine
    assert "steps" not in t.config["trainer"]
    assert "set trainer.steps to 15 x (rows // 256)" in notes(t, "lost")["trainer.total_epochs"]
    t = translate("verl", [*quickstart_items(), "trainer.total_training_steps=100"])
    assert validate(t.config).trainer.steps == 100


def test_verl_rows_are_counted_from_local_parquet(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    rows = [
        {"prompt": [{"role": "user", "content": f"{i}+1?"}], "reward_model": {"ground_truth": str(i + 1)}}
        for i in range(10)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    items = [f"data.train_files={tmp_path / 'train.parquet'}", "data.train_batch_size=4", "trainer.total_epochs=3"]
    items += ["actor_rollout_ref.actor.ppo_mini_batch_size=2"]
    t = translate("verl", [*items, "actor_rollout_ref.rollout.name=hf", "trainer.n_gpus_per_node=1"])
    cfg = validate(t.config)
    assert cfg.trainer.steps == 3 * (10 // 4)
    assert cfg.data.path == str(tmp_path / "train.parquet") and cfg.rollout.engine == "hf"


def test_verl_reward_function_file_and_reward_model():
    items = [
        *quickstart_items(),
        "custom_reward_function.path=rewards/gsm8k_score.py",
        "custom_reward_function.name=score",
        "+custom_reward_function.reward_kwargs={strict: true}",
    ]
    t = translate("verl", items, train_rows=GSM8K_TRAIN_ROWS)
    reward = t.config["rewards"][0]
    assert reward == {
        "function": "python",
        "path": "rewards/gsm8k_score.py",
        "function_name": "score",
        "kwargs": {"strict": True},
    }
    validate(t.config)
    t = translate("verl", [*items, "reward_model.enable=True", "reward_model.model.path=/models/rm"])
    assert t.config["rewards"] == [{"function": "reward_model", "model": "/models/rm", "trust_remote_code": False}]
    assert "custom_reward_function.path" in notes(t, "ignored")
    validate(t.config)


def test_verl_kl_settings():
    # ppo: the KL penalty in the rewards with verl's estimator names and the adaptive controller
    items = [
        *quickstart_items(),
        "algorithm.use_kl_in_reward=True",
        "algorithm.kl_penalty=low_var_kl",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.target_kl=0.05",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_type=mse",
    ]
    alg = validate(translate("verl", items, train_rows=GSM8K_TRAIN_ROWS).config).algorithm.options
    assert (alg.use_kl_in_reward, alg.kl_penalty, alg.kl_ctrl, alg.kl_coef, alg.kl_target) == (
        True,
        "k3",
        "adaptive",
        0.001,
        0.05,
    )
    assert (alg.use_kl_loss, alg.kl_loss_type, alg.kl_loss_coef) == (True, "k2", 0.001)
    # grpo: k1 as a loss is refused by hybridrl: said, and k3 used; k3+ is k2's gradient
    grpo = [str(FIXTURES / "verl_grpo_gsm8k.yaml")]
    t = translate("verl", [*grpo, "actor_rollout_ref.actor.kl_loss_type=kl"], train_rows=GSM8K_TRAIN_ROWS)
    assert t.config["algorithm"]["kl_kind"] == "k3"
    assert "refused" in notes(t, "lost")["actor_rollout_ref.actor.kl_loss_type"]
    t = translate("verl", [*grpo, "actor_rollout_ref.actor.kl_loss_type=k3+"], train_rows=GSM8K_TRAIN_ROWS)
    assert t.config["algorithm"]["kl_kind"] == "k2"
    validate(t.config)


def test_verl_estimators_losses_and_dapo():
    grpo = [str(FIXTURES / "verl_grpo_gsm8k.yaml")]
    t = translate(
        "verl",
        [
            *grpo,
            "algorithm.adv_estimator=rloo",
            "actor_rollout_ref.actor.clip_ratio_high=0.28",
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
            "+actor_rollout_ref.actor.loss_scale_factor=2048",
            "+algorithm.filter_groups.enable=true",
            "+algorithm.filter_groups.max_num_gen_batches=5",
            "+reward_model.overlong_buffer.enable=true",
            "+reward_model.overlong_buffer.len=256",
            "+reward_model.overlong_buffer.penalty_factor=1.0",
            "algorithm.rollout_correction.rollout_is=token",
        ],
        train_rows=GSM8K_TRAIN_ROWS,
    )
    cfg = validate(t.config)
    alg = cfg.algorithm.options
    assert alg.estimator == "rloo" and (alg.clip_low, alg.clip_high) == (0.2, 0.28)
    assert alg.loss_agg_mode == "seq-mean-token-sum-norm" and alg.loss_norm_length == 2048
    assert alg.dynamic_sampling and cfg.rollout.refill_rounds == 4  # 5 generation batches = 1 + 4 refills
    assert (alg.overlong_buffer_len, alg.overlong_penalty_factor, alg.overlong_max_length) == (256, 1.0, 1024)
    assert (alg.rollout_correction, alg.rollout_correction_cap) == ("token", 2.0)
    t = translate("verl", [*grpo, "algorithm.adv_estimator=remax"], train_rows=GSM8K_TRAIN_ROWS)
    assert "algorithm.adv_estimator" in notes(t, "lost") and t.config["algorithm"]["estimator"] == "grpo"


def test_verl_interpolations_of_its_generated_config_are_followed():
    given = {
        "actor_rollout_ref.actor.ppo_mini_batch_size": 32,
        "actor_rollout_ref.rollout.n": 2,
        "critic.ppo_mini_batch_size": "${oc.select:actor_rollout_ref.actor.ppo_mini_batch_size,256}",
        "trainer.default_local_dir": "checkpoints/${trainer.project_name}/${trainer.experiment_name}",
        "trainer.project_name": "p",
    }
    from hybridrl_migrate import verl

    t = verl.translate(given, train_rows=GSM8K_TRAIN_ROWS)
    assert t.config["algorithm"]["critic_mini_batch_size"] == 64
    assert t.config["trainer"]["run_dir"] == "checkpoints/p/gsm8k" and t.config["trainer"]["resume"] is True


def test_overrides_read_as_hydra_reads_them():
    assert parse_value("1e-6") == 1e-6 and parse_value("True") is True and parse_value("null") is None
    assert parse_value('["console","wandb"]') == ["console", "wandb"] and parse_value("[a, 2e-3]") == ["a", 2e-3]
    assert parse_value("'error'") == "error" and parse_value("low_var_kl") == "low_var_kl"
    flat = apply_items({"a.b": 1, "a.c": 2, "d": 3}, ["~a", "+e.f=4", "++d=5"])
    assert flat == {"d": 5, "e.f": 4}
    with pytest.raises(ConfigError, match="defaults"):
        translate("verl", [str(FIXTURES / "hydra_defaults.yaml")])


# -- TRL -----------------------------------------------------------------------------------


def test_trl_config_file_translates_with_its_units():
    t = translate("trl", [str(FIXTURES / "trl_grpo.yaml")], world_size=4)
    cfg = validate(t.config)
    tr, alg = cfg.trainer, cfg.algorithm.options
    # a generation batch: 16 per device x 4 processes x 4 steps (= gradient accumulation) = 256 completions
    assert tr.prompts_per_step == 256 // 16 and cfg.rollout.n == 16
    assert tr.mini_batch_size == 16 * 4 * 4  # completions per optimizer step: one per generation batch
    assert tr.micro_batch_size == 16 and tr.epochs == 2  # num_iterations
    assert tr.steps == 400 // 2  # max_steps counts optimizer steps: 2 per generation batch (num_iterations)
    assert tr.warmup_steps == 10 and tr.save_every == 50 and tr.keep_last == 3 and tr.seed == 42
    assert tr.run_dir == "runs/qwen-grpo" and tr.lr == 1e-6
    assert (alg.kl_coef, alg.kl_kind, alg.clip_low, alg.clip_high) == (0.001, "k3", 0.2, 0.28)
    assert alg.loss_agg_mode == "token-mean" and alg.norm_adv_by_std and alg.eps == 1e-4
    assert (alg.rollout_mask, alg.rollout_mask_high) == ("sequence", 3.0)  # TRL's vLLM IS default
    assert cfg.rollout.engine == "vllm" and cfg.rollout.options.gpu_memory_utilization == 0.4
    assert cfg.rollout.max_tokens == 1024 and cfg.rollout.temperature == 0.9
    assert cfg.model.dtype == "bfloat16" and cfg.sharding.strategy == "fsdp"
    assert [r.label for r in cfg.rewards] == ["think_format_reward", "boxed_match"]
    assert [r.weight for r in cfg.rewards] == [0.2, 1.0]
    assert t.config["rewards"][1] == {
        "function": "python",
        "name": "boxed_match",
        "path": "my_rewards/math.py",
        "function_name": "boxed_match",
        "style": "trl",
        "weight": 1.0,
    }
    assert cfg.logging.loggers == ["console", "wandb", "jsonl"] and cfg.logging._options["console"].every == 2
    assert not t.report.of("unknown") and "lr_scheduler_type" not in notes(t, "lost")


def test_trl_script_keyword_arguments():
    """TRL's quick start (docs/source/grpo_trainer.md): GRPOTrainer(model=..., reward_funcs=accuracy_reward,
    train_dataset=DeepMath-103K) with GRPOConfig's defaults, launched on 8 GPUs."""
    items = ["model=Qwen/Qwen2.5-0.5B-Instruct", "reward_funcs=accuracy_reward", "dataset_name=trl-lib/DeepMath-103K"]
    t = translate("trl", items, world_size=8)
    cfg = validate(t.config)
    assert cfg.trainer.prompts_per_step == 8 * 8 // 8 and cfg.trainer.mini_batch_size == 64
    assert cfg.trainer.micro_batch_size == 8 and cfg.rollout.n == 8 and cfg.rollout.max_tokens == 512
    assert cfg.algorithm.options.kl_coef == 0.0 and cfg.algorithm.options.loss_agg_mode == "token-mean"
    assert cfg.data.path == "trl-lib/DeepMath-103K" and cfg.data.answer_column == "solution"
    lost = notes(t, "lost")
    assert "math_verify" in lost["reward_funcs"] and "lr_scheduler_type" not in lost
    assert cfg.trainer.lr_schedule == "linear"  # TRL's default schedule, over the run's steps
    assert "rows // 8" in lost["num_train_epochs"]
    t = translate("trl", [*items, "num_train_epochs=2"], train_rows=1000, world_size=8)
    assert t.config["trainer"]["steps"] == 2 * (1000 // 8)


@pytest.mark.parametrize(
    "loss, mode", [("grpo", "seq-mean-token-mean"), ("bnpo", "token-mean"), ("dr_grpo", "seq-mean-token-sum-norm")]
)
def test_trl_loss_types(loss, mode):
    t = translate("trl", ["model=m", "dataset_name=d", "reward_funcs=think_format_reward", f"loss_type={loss}"])
    alg = validate(t.config).algorithm.options
    assert alg.loss_agg_mode == mode
    assert alg.loss_norm_length == (512 if loss == "dr_grpo" else None)  # dr_grpo's max_completion_length


def test_trl_steps_per_generation_and_unsupported_settings():
    items = [
        "model=m",
        "dataset_name=d",
        "reward_funcs=think_format_reward",
        "per_device_train_batch_size=4",
        "gradient_accumulation_steps=2",
        "steps_per_generation=4",
        "max_steps=100",
        "scale_rewards=batch",
        "top_entropy_quantile=0.2",
        "loss_type=cispo",
        "label_smoothing_factor=0.1",  # a TrainingArguments argument no rule reads: listed
    ]
    t = translate("trl", items, world_size=2)
    cfg = validate(t.config)
    assert cfg.trainer.prompts_per_step == 4 * 2 * 4 // 8  # one generation batch, 8 completions per prompt
    assert cfg.trainer.mini_batch_size == 4 * 2 * 2  # two optimizer steps per generation batch
    assert cfg.trainer.steps == 100 // 2
    lost = notes(t, "lost")
    assert {"scale_rewards", "top_entropy_quantile", "loss_type"} <= set(lost)
    assert {n.key for n in t.report.of("unknown")} == {"label_smoothing_factor"}


def test_trl_soft_overlong_punishment_is_an_option_of_grpo():
    items = ["model=m", "dataset_name=d", "reward_funcs=[think_format_reward,get_soft_overlong_punishment]"]
    cfg = validate(translate("trl", [*items, "reward_weights=[1.0,0.5]"]).config)
    alg = cfg.algorithm.options  # the trl grpo script's: max_completion_len 1280, soft_punish_cache 256
    assert (alg.overlong_buffer_len, alg.overlong_max_length, alg.overlong_penalty_factor) == (256, 1280, 0.5)
    assert [(r.label, r.weight) for r in cfg.rewards] == [("think_format_reward", 1.0)]


def test_trl_evaluation():
    items = ["model=m", "dataset_name=d", "reward_funcs=think_format_reward", "num_iterations=2"]
    items += ["eval_strategy=steps", "eval_steps=20", "num_generations_eval=4"]
    t = translate("trl", items)
    cfg = validate(t.config)
    (s,) = cfg.data.eval
    assert (s.name, s.options.path, s.options.split, s.greedy, s.n) == ("test", "d", "test", False, 4)
    assert cfg.trainer.eval_every == 10  # 20 optimizer steps, 2 per generation batch
    assert not cfg.trainer.eval_before_train  # TRL's eval_on_start is off


# -- the command line ----------------------------------------------------------------------


def run_cli(*args, cwd):
    env = {**os.environ, "HOME": str(cwd)}
    return subprocess.run(
        [sys.executable, "-m", "hybridrl.cli", "import", *args], capture_output=True, text=True, cwd=cwd, env=env
    )


def test_cli_import_verl_writes_the_config_and_checks_it_as_validate_does(tmp_path):
    out = tmp_path / "run.yaml"
    proc = run_cli(
        "verl",
        *quickstart_items(),
        "actor_rollout_ref.rollout.n=8",
        "-o",
        str(out),
        "--train-rows",
        "7473",
        cwd=tmp_path,
    )
    assert proc.stdout == ""
    assert "Units converted" in proc.stderr and "trainer.mini_batch_size 512 responses" in proc.stderr
    assert "log_prob_micro_batch_size_per_gpu" in proc.stderr  # left out, and said so
    # written, and checked as hybridrl validate checks it: the model is not on this machine
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1].startswith(
        f"error: {out} does not validate: model.path 'Qwen/Qwen2.5-0.5B-Instruct' does not exist."
    )
    written = yaml.safe_load(out.read_text())
    assert written["trainer"]["prompts_per_step"] == 256 and written["trainer"]["mini_batch_size"] == 512
    assert written["data"]["path"] == f"{tmp_path}/data/gsm8k/train.parquet"  # $HOME as the shell expands it
    cfg = load_config(out)
    assert cfg.trainer.steps == 435 and cfg.algorithm.options.critic_mini_batch_size == 512


def test_cli_import_trl_prints_the_config(tmp_path):
    proc = run_cli("trl", str(FIXTURES / "trl_grpo.yaml"), "max_steps=40", "--world-size", "4", cwd=tmp_path)
    assert proc.returncode == 1 and "error: the config above does not validate: model.path 'Qwen/" in proc.stderr
    config = yaml.safe_load(proc.stdout)
    assert config["trainer"]["steps"] == 20 and config["algorithm"]["clip_high"] == 0.28
    assert "Units converted" in proc.stderr
    proc = run_cli("trl", "does_not_exist.yaml", cwd=tmp_path)
    assert proc.returncode == 2 and "Config file not found" in proc.stderr


def test_cli_import_checks_the_config_as_validate_does(tmp_path, tiny_model, capsys):
    """What hybridrl validate refuses, the import does not call valid: the same checks, before any
    model loads (a package: model without gguf_file, here a folder of GGUF files alone)."""
    from hybridrl import cli

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1 + 1 =", "solution": "2"}\n{"prompt": "2 + 2 =", "solution": "4"}\n')
    out = tmp_path / "run.yaml"
    items = [f"dataset_name={rows}", "reward_funcs=[think_format_reward]", "max_steps=2", "num_generations=2"]
    items += ["per_device_train_batch_size=2", "max_completion_length=16", "-o", str(out)]
    assert cli.main(["import", "trl", f"model_name_or_path={tiny_model}", *items]) == 0
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"{out}: valid (algorithm 'grpo'")

    gguf_only = tmp_path / "gguf-only"
    gguf_only.mkdir()
    (gguf_only / "m.gguf").write_bytes(b"")
    assert cli.main(["import", "trl", f"model_name_or_path={gguf_only}", *items]) == 1
    imported = capsys.readouterr().err.splitlines()[-1]
    assert cli.main(["validate", str(out)]) == 2
    validated = capsys.readouterr().err
    assert validated == f"error: model.path '{gguf_only}' has no config.json. It holds m.gguf: set model.gguf_file.\n"
    assert imported == validated.strip().replace("error: ", f"error: {out} does not validate: ", 1)


def test_verl_mini_batch_that_does_not_divide_the_batch_is_refused():
    with pytest.raises(ConfigError, match="verl refuses it too"):
        translate("verl", [*quickstart_items(), "actor_rollout_ref.actor.ppo_mini_batch_size=100"])


def test_learning_rate_schedules_translate():
    """verl's cosine (to min_lr_ratio) and TRL's linear default become trainer.lr_schedule; what has
    no equivalent (verl's num_cycles other than half a period) is listed."""
    a = "actor_rollout_ref.actor.optim"
    t = translate("verl", [*quickstart_items(), f"{a}.lr_scheduler_type=cosine", f"{a}.min_lr_ratio=0.1"])
    cfg = validate(t.config)
    assert (cfg.trainer.lr_schedule, cfg.trainer.min_lr_ratio) == ("cosine", 0.1)
    t = translate("verl", [*quickstart_items(), f"{a}.lr_scheduler_type=cosine", f"{a}.num_cycles=2"])
    assert "half a period" in notes(t, "lost")[f"{a}.num_cycles"]
    t = translate("trl", ["model=m", "lr_scheduler_type=cosine_with_min_lr", "lr_scheduler_kwargs.min_lr_rate=0.2"])
    cfg = validate(t.config)
    assert (cfg.trainer.lr_schedule, cfg.trainer.min_lr_ratio) == ("cosine", 0.2)


def test_a_self_referencing_interpolation_and_an_infinite_number_are_error_lines():
    """verl's ${...} that reaches itself, and 1e400 (inf) for a count: one ConfigError each, never a
    RecursionError or an OverflowError."""
    with pytest.raises(ConfigError, match=r"refers to itself through interpolations"):
        translate("verl", [*quickstart_items(), "data.train_batch_size=${data.train_batch_size}"])
    with pytest.raises(ConfigError, match=r"'1e400' is not a finite number"):
        translate("verl", [*quickstart_items(), "data.train_batch_size=1e400"])
