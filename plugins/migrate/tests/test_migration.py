"""Migrating from verl and TRL. Their data and reward functions, used as they are, through the real
trainer: verl's GSM8K quickstart layout rebuilt from a small generated set, and a TRL dataset with a
TRL reward function. And what ``hybridrl import`` must not change silently: the algorithm (GSPO's
aggregation, the warm-up), the steps, and the keys it takes (a typo is refused, as verl and TRL refuse it)."""

import copy
import json
import random
import re
import shlex
import textwrap
from pathlib import Path

import pytest
from hybridrl_migrate import translate
from hybridrl_testing import metrics_rows

from hybridrl import cli, plugins
from hybridrl.batch import Batch
from hybridrl.config import load_config
from hybridrl.errors import ConfigError
from hybridrl.run import build_run
from hybridrl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[3]  # the repository, for examples/
FIXTURES = Path(__file__).parent / "fixtures"
QUICKSTART, GSPO = "verl_quickstart_ppo.sh", "verl_gspo_qwen30b.sh"
# verl's examples/data_preprocess/gsm8k.py appends this to every question
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def gsm8k_raw(size: int, seed: int = 0) -> list[dict]:
    """GSM8K-shaped problems: a word question, and an answer whose last line is ``#### <number>``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        question = f"Tom has {a} pens and buys {b} more. How many pens now?"
        rows.append(
            {"question": question, "answer": f"Tom has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} pens.\n#### {a + b:,}"}
        )
    return rows


def verl_gsm8k(raw: list[dict], split: str) -> list[dict]:
    """The rows verl's GSM8K preprocessing writes: the question with the instruction as one user
    message, the number after '####' (without thousands separators) as the rule's ground truth."""
    rows = []
    for index, example in enumerate(raw):
        solution = re.search(r"#### (\-?[0-9\.\,]+)", example["answer"]).group(1).replace(",", "")
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": example["question"] + " " + INSTRUCTION}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": solution},
                "extra_info": {
                    "split": split,
                    "index": index,
                    "answer": example["answer"],
                    "question": example["question"],
                },
            }
        )
    return rows


def write_parquet(rows: list[dict], path: Path) -> str:
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))  # as verl's script saves them
    return str(path)


SPY = """
import json


def compute_score(data_source, solution_str, ground_truth, extra_info=None, log=None):
    seen = {"data_source": data_source, "ground_truth": ground_truth, "extra_info": extra_info}
    with open(log, "a") as f:
        f.write(json.dumps(seen) + "\\n")
    return 0.0
"""


def run(config: dict, tmp_path: Path) -> list[dict]:
    Trainer(build_run(load_config(data=config))).train()
    return metrics_rows(tmp_path / "run")


def base_config(model, tmp_path, data: dict, rewards: list[dict]) -> dict:
    return {
        "model": {"path": model},
        "data": data,
        "rollout": {"engine": "hf", "n": 4, "max_tokens": 16},
        "rewards": rewards,
        "algorithm": {"name": "grpo"},
        "trainer": {"steps": 2, "prompts_per_step": 2, "run_dir": str(tmp_path / "run"), "sample_every": 1},
        "logging": {"loggers": ["jsonl"]},
    }


def test_verl_gsm8k_quickstart_data_and_compute_score_run_unchanged(tiny_model, tmp_path):
    train = write_parquet(verl_gsm8k(gsm8k_raw(16), "train"), tmp_path / "train.parquet")
    (tmp_path / "spy.py").write_text(textwrap.dedent(SPY))
    log = tmp_path / "calls.jsonl"
    rewards = [
        {"function": "python", "name": "gsm8k", "path": str(ROOT / "examples/verl_gsm8k_reward.py")},
        {
            "function": "python",
            "name": "spy",
            "path": str(tmp_path / "spy.py"),
            "kwargs": {"log": str(log)},
            "weight": 0,
        },
    ]
    rows = run(base_config(tiny_model, tmp_path, {"source": "hf", "path": train}, rewards), tmp_path)

    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["reward/gsm8k/errors"] == 0.0 and "reward/gsm8k/mean" in rows[-1]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 2 * 2 * 4  # steps x prompts x n, each response one call
    for call in calls:  # verl's fields reached the reward function, the nested ones too, and what verl adds
        info = call["extra_info"]
        assert call["data_source"] == "openai/gsm8k" and set(info) == {"split", "index", "answer", "question"} | {
            "num_turns",
            "rollout_reward_scores",
        }
        assert (info["num_turns"], info["rollout_reward_scores"]) == (2, {})  # verl's SingleTurnAgentLoop: 2
        assert call["ground_truth"] == info["answer"].rsplit("#### ", 1)[1].replace(",", "")
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert INSTRUCTION in samples[0]["prompt"] and samples[0]["answer"].isdigit()


def test_verl_gsm8k_scorer_is_strict():
    import importlib.util

    spec = importlib.util.spec_from_file_location("scorer", ROOT / "examples/verl_gsm8k_reward.py")
    scorer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scorer)
    assert scorer.compute_score("openai/gsm8k", "3 + 4 = 7\n#### 7", "7") == 1.0
    assert scorer.compute_score("openai/gsm8k", "so #### 1,234", "1234") == 1.0
    assert scorer.compute_score("openai/gsm8k", "#### 8", "7", format_score=0.1) == 0.1
    assert scorer.compute_score("openai/gsm8k", "the answer is 7", "7") == 0.0  # no '####': no score


TRL_REWARD = '''
def accuracy(completions, solution, **kwargs) -> list[float]:
    """TRL's reward function signature: one float per completion."""
    assert all(isinstance(c, str) for c in completions), "standard format: completions are strings"
    assert "prompts" in kwargs and "completion_ids" in kwargs
    return [float(c.strip() == s) for c, s in zip(completions, solution)]
'''


def test_trl_dataset_and_reward_function_run_unchanged(tiny_model, tmp_path):
    rows = [{"prompt": f"{i}+{i}=", "solution": str(2 * i), "level": i % 3} for i in range(12)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rewards.py").write_text(textwrap.dedent(TRL_REWARD))
    reward = {"function": "python", "name": "accuracy", "path": f"{tmp_path / 'rewards.py'}:accuracy", "style": "trl"}
    data = {"source": "hf", "path": str(tmp_path / "train.jsonl")}
    metrics = run(base_config(tiny_model, tmp_path, data, [reward]), tmp_path)
    assert [r["step"] for r in metrics] == [1, 2]
    assert metrics[-1]["reward/accuracy/errors"] == 0.0 and metrics[-1]["reward/accuracy/not_applicable"] == 0.0


def test_verl_compute_score_gets_num_turns_and_rollout_reward_scores_as_verl_gives_them(tmp_path):
    """verl's reward managers add num_turns (ToolAgentLoop: user_turns + assistant_turns + 1; 2 for a
    single turn) and the row's reward_scores ({} without) to extra_info; the row keeps its own."""
    (tmp_path / "spy.py").write_text(textwrap.dedent(SPY))
    log = tmp_path / "calls.jsonl"
    cls = plugins.lookup("reward function", "python")
    fn = cls(cls.Options.model_validate({"path": str(tmp_path / "spy.py"), "kwargs": {"log": str(log)}}), ctx=None)
    row = {"data_source": "s", "extra_info": {"index": 1}}
    assistant, tool = {"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"}
    b = Batch()
    b["response_text"], b["answer"] = ["x", "y", "z"], ["1", "1", "1"]
    b["row"] = [row, row, {**row, "reward_scores": {"search": [1.0]}}]
    b["trajectory"] = [[assistant], [assistant, tool, tool, assistant], [assistant, tool, assistant, tool, assistant]]
    try:
        fn.score(b)
    finally:
        fn.close()
    seen = [json.loads(line)["extra_info"] for line in log.read_text().splitlines()]
    seen = sorted((i["num_turns"], i["rollout_reward_scores"]) for i in seen)  # the workers' order
    assert seen == [(2, {}), (4, {}), (6, {"search": [1.0]})]
    assert row == {"data_source": "s", "extra_info": {"index": 1}}


# -- hybridrl import: the algorithm, the steps and the keys verl or TRL would take ---------------


def script_items(name: str) -> list[str]:
    """The key=value items of a verl command in fixtures/ (its comments left out)."""
    text = "\n".join(line for line in (FIXTURES / name).read_text().splitlines() if line[:1] != "#")
    return [item for item in shlex.split(text.replace("\\\n", " ")) if "=" in item]


def notes(t, kind: str) -> dict[str, str]:
    return {n.key: n.why for n in t.report.of(kind)}


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_verl_gspo_loss_is_a_mean_per_sequence_whatever_loss_agg_mode_says(agg):
    """verl's compute_policy_loss_gspo aggregates with seq-mean-token-mean whatever loss_agg_mode says:
    its own GSPO example (loss_agg_mode left at token-mean) trains that, with the dapo reward manager's
    overlong punishment; entropy and KL terms, which verl aggregates with loss_agg_mode, are said to differ."""
    items = [*script_items(GSPO), f"actor_rollout_ref.actor.loss_agg_mode={agg}"]
    t = translate("verl", items)
    alg = load_config(data=copy.deepcopy(t.config)).algorithm.options
    assert (alg.policy_loss, alg.loss_agg_mode, alg.clip_low, alg.clip_high, alg.kl_coef) == (
        "gspo",
        "seq-mean-token-mean",
        3e-4,
        4e-4,
        0.0,
    )
    assert (alg.overlong_buffer_len, alg.overlong_penalty_factor, alg.overlong_max_length) == (4096, 1.0, 8192)
    assert "compute_policy_loss_gspo" in notes(t, "note")["actor_rollout_ref.actor.loss_agg_mode"]
    assert "actor_rollout_ref.actor.loss_agg_mode" not in notes(t, "lost") and not t.report.of("unknown")
    t = translate("verl", [*items, "actor_rollout_ref.actor.entropy_coeff=0.001"])
    assert "entropy and KL terms" in notes(t, "lost")["actor_rollout_ref.actor.loss_agg_mode"]


@pytest.mark.parametrize(
    "given, ratio, workers, warmup",
    [
        (-1, 0.1, "auto", 10),  # verl's default: the ratio of total_training_steps
        (0, 0.1, "auto", 0),  # the default (legacy) FSDP worker takes the ratio for a negative value only
        (0, 0.1, "disable", 10),  # its engine workers (FSDPEngine._build_lr_scheduler) for 0 too
        (5, 0.1, "auto", 5),
    ],
)
def test_verl_warmup_follows_verls_rule_and_says_hybridrls_is_a_step_ahead(given, ratio, workers, warmup):
    a = "actor_rollout_ref.actor.optim"
    items = [*script_items(QUICKSTART), "trainer.total_training_steps=100", f"{a}.lr_warmup_steps={given}"]
    items += [f"{a}.lr_warmup_steps_ratio={ratio}", f"trainer.use_legacy_worker_impl={workers}"]
    t = translate("verl", items)
    assert load_config(data=copy.deepcopy(t.config)).trainer.warmup_steps == warmup
    said = " ".join(notes(t, "note").values())
    if warmup:
        assert f"one step earlier than verl's: its first step trains at lr/{warmup}, verl's first update at 0" in said
    else:
        assert "no warm-up" in said and "for those set trainer.warmup_steps: 10" in said


@pytest.mark.parametrize(
    "schedule, given, warmup",
    [
        ("constant", "warmup_steps=20", 0),  # get_scheduler builds get_constant_schedule: no warm-up
        ("constant", "warmup_ratio=0.1", 0),
        ("constant_with_warmup", "warmup_steps=20", 20),
        ("linear", "warmup_steps=0.1", 10),  # transformers 5: below 1, a ratio of the steps
    ],
)
def test_trl_warmup_follows_transformers_schedules(schedule, given, warmup):
    t = translate("trl", ["model=m", "dataset_name=d", "max_steps=100", f"lr_scheduler_type={schedule}", given])
    assert load_config(data=copy.deepcopy(t.config)).trainer.warmup_steps == warmup
    said = notes(t, "note")[given.split("=")[0]]
    assert ("one step earlier than TRL's" if warmup else "constant has no warm-up in transformers") in said


def test_too_few_rows_for_one_step_are_refused_and_epochs_bound_the_steps():
    """verl's loader drops the last partial batch (drop_last=True) and then refuses an empty one ('Train
    dataloader is empty!'); TRL's RepeatSampler drops it and trains nothing. The config written used to
    train trainer.steps' default 10 where the report said 0."""
    fix = "Lower data.train_batch_size to 100 or less, or give more rows"
    for extra in ([], ["trainer.total_training_steps=5"]):
        with pytest.raises(ConfigError, match=f"data.train_batch_size=256 is more than the 100 rows.* {fix}"):
            translate("verl", [*script_items(QUICKSTART), *extra], train_rows=100)
    t = translate("verl", [*script_items(QUICKSTART), "trainer.total_training_steps=100"], train_rows=1000)
    assert t.config["trainer"]["steps"] == 15 * 3  # verl's loop ends with its last epoch
    with pytest.raises(ConfigError, match="takes 8 prompts, more than the 5 rows .* Lower per_device_train_batch_size"):
        translate(
            "trl", ["model=m", "dataset_name=d", "per_device_train_batch_size=16", "num_generations=2"], train_rows=5
        )


def test_16_bit_compute_is_noted_for_cpu_runs():
    """verl computes in bfloat16 and TRL's bf16 is on by default: on a CPU that is slower than float32
    and makes the trainer's logprobs differ from the rollout's, which the report says, with the fix."""
    fsdp = "actor_rollout_ref.actor.fsdp_config"
    t = translate("verl", script_items(QUICKSTART))
    assert t.config["sharding"]["mixed_precision"] == "bf16" and "device" not in t.config["trainer"]
    said = notes(t, "note")[f"{fsdp}.dtype"]
    assert "on a CPU it is slower than float32" in said and said.endswith("set sharding.mixed_precision: off")
    t = translate("verl", [*script_items(QUICKSTART), f"{fsdp}.model_dtype=bf16"])
    assert notes(t, "note")[f"{fsdp}.model_dtype"].endswith("mixed_precision: off and model.dtype: float32")
    t = translate("verl", [*script_items(QUICKSTART), f"{fsdp}.dtype=fp32"])
    assert t.config["sharding"]["mixed_precision"] == "off" and "on a CPU" not in str(notes(t, "note"))
    assert "on a CPU" in notes(translate("trl", ["model=m"]), "note")["bf16"]
    assert "on a CPU" not in str(notes(translate("trl", ["model=m", "bf16=false"]), "note"))


@pytest.mark.parametrize(
    "framework, item, near",
    [
        ("verl", "actor_rollout_ref.actor.ppo_mini_batch_szie=2", "actor_rollout_ref.actor.ppo_mini_batch_size"),
        ("verl", "actor_rollout_ref.actor.policy_loss.loss_mod=gspo", "actor_rollout_ref.actor.policy_loss.loss_mode"),
        ("verl", "trainer.train_batch_size=64", "data.train_batch_size"),  # a key of another section
        ("trl", "num_generation=4", "num_generations"),
        ("trl", "model_init_kwarg.dtype=bfloat16", "model_init_kwargs"),
    ],
)
def test_keys_verl_or_trl_would_refuse_are_refused_with_the_nearest(framework, item, near, capsys):
    """Hydra's struct mode and TRL's parser refuse a key they lack (a typo): so does the import, which
    used to list it and exit 0."""
    base = script_items(QUICKSTART) if framework == "verl" else ["model=m", "dataset_name=d"]
    key = item.split("=")[0] if framework == "verl" else item.split("=")[0].split(".")[0]
    what = "verl key" if framework == "verl" else "TRL argument"
    message = f"unknown {what} '{key}'; did you mean '{near}'? ({what.split()[0]} would refuse it too)"
    with pytest.raises(ConfigError) as e:
        translate(framework, [*base, item])
    assert str(e.value) == message
    assert cli.main(["import", framework, *base, item]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_keys_of_verls_files_and_versions_are_known(tmp_path):
    """A typo in a YAML file is refused as one in an override; keys of other verl versions (0.9's reward
    section, 0.10's LoRA section, the Megatron optimizer's), free-form mappings and keys added with
    Hydra's '+' (which verl takes) are translated or listed."""
    (tmp_path / "run.yaml").write_text("actor_rollout_ref:\n  actor:\n    ppo_epoch: 2\n")
    with pytest.raises(ConfigError, match="did you mean 'actor_rollout_ref.actor.ppo_epochs'"):
        translate("verl", [*script_items(QUICKSTART), str(tmp_path / "run.yaml")])
    with pytest.raises(ConfigError, match=r"'trainer.mystery' \(verl would refuse it too\); a newer verl's key"):
        translate("verl", [*script_items(QUICKSTART), "trainer.mystery=x"])
    items = ["reward.num_workers=4", "actor_rollout_ref.model.lora.rank=8", "+trainer.mystery=x"]
    items += ["actor_rollout_ref.actor.optim.lr_decay_style=cosine", "actor_rollout_ref.rollout.engine_kwargs.vllm.a=1"]
    t = translate("verl", [*script_items(QUICKSTART), *items], train_rows=7473)
    assert "LoRA section" in notes(t, "lost")["actor_rollout_ref.model.lora.rank"]
    assert {"actor_rollout_ref.actor.optim.lr_decay_style", "trainer.mystery"} <= set(notes(t, "unknown"))
