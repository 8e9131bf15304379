"""verl's and TRL's data and reward functions, used as they are, through the real trainer: verl's GSM8K
quickstart layout rebuilt from a small generated set, and a TRL dataset with a TRL reward function."""

import json
import random
import re
import textwrap
from pathlib import Path

from hybridrl.config import load_config
from hybridrl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
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
    Trainer(load_config(data=config)).train()
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


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
    for call in calls:  # verl's fields reached the reward function, the nested ones too
        info = call["extra_info"]
        assert call["data_source"] == "openai/gsm8k" and set(info) == {"split", "index", "answer", "question"}
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
