"""The core's loggers: the JSONL schema and the console.

One short real run (tiny random Llama, 2 steps, GRPO) writes metrics.jsonl and samples.jsonl; the
tests read them back. The wandb and tensorboard loggers are the trackers plugin's (plugins/trackers).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from hybridrl.builtin.loggers import ConsoleLogger, JSONLLogger, clean_metrics, summary_line
from hybridrl.components import RunContext
from hybridrl.config import load_config

STEPS, PROMPTS, N = 2, 2, 4
REWARDS = [{"function": "format", "pattern": "7"}, {"function": "answer_match", "weight": 0.5}]
# what the trainer logs every step (names as in verl/TRL), checked against metrics.jsonl
STEP_METRICS = [
    "reward/mean",
    "reward/std",
    "reward/min",
    "reward/max",
    "reward/format/mean",
    "reward/answer_match/mean",
    "actor/kl",
    "actor/entropy",
    "actor/clipfrac",
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/lr",
    "response_length/mean",
    "response_length/max",
    "response_length/min",
    "response_length/clip_ratio",
    "throughput/rollout_tokens_per_s",
    "rollout/logprob_diff_mean",
    "rollout/logprob_diff_max",
    "advantages/mean",
    "advantages/max",
    "advantages/min",
    "timing/rollout",
    "timing/reward",
    "timing/logprobs",
    "timing/advantages",
    "timing/update",
    "timing/sync",
    "timing/step",
]


def ctx(run_dir: Path) -> RunContext:
    return RunContext(
        model_path="", tokenizer=None, device=torch.device("cpu"), dtype=torch.float32, seed=0, run_dir=run_dir
    )


def strict_json(line: str):
    def reject(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(line, parse_constant=reject)


@pytest.fixture(scope="module")
def real_run(tiny_model, tmp_path_factory):
    """A 2-step GRPO run logging to jsonl."""
    from hybridrl.run import build_run
    from hybridrl.trainer import Trainer

    tmp = tmp_path_factory.mktemp("loggers")
    run_dir = tmp / "run"
    cfg = load_config(
        data={
            "model": {"path": tiny_model},
            "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 16},
            "rollout": {"engine": "hf", "n": N, "max_tokens": 8},
            "rewards": REWARDS,
            "algorithm": {"name": "grpo", "kl_coef": 0.001},
            "trainer": {
                "steps": STEPS,
                "prompts_per_step": PROMPTS,
                "lr": 1e-2,
                "run_dir": str(run_dir),
                "sample_every": 1,
            },
            "logging": {"loggers": ["jsonl"]},
        }
    )
    Trainer(build_run(cfg, name="loggers")).train()
    metrics = [strict_json(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = [strict_json(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    return run_dir, metrics, samples


# --- JSONL ---------------------------------------------------------------------------------


def test_metrics_jsonl_has_one_row_per_step_with_the_known_names(real_run):
    _, metrics, _ = real_run
    assert [row["step"] for row in metrics] == list(range(1, STEPS + 1))
    for row in metrics:
        missing = [k for k in STEP_METRICS if k not in row]
        assert not missing, f"step {row['step']} lacks {missing}"
        assert isinstance(row["time"], float) and row["time"] > 1.6e9
        for key, value in row.items():
            assert value is None or isinstance(value, (int, float)), (key, value)
    assert metrics[0]["time"] <= metrics[1]["time"]


def test_samples_jsonl_rows_match_the_step_metrics(real_run):
    _, metrics, samples = real_run
    assert [s["step"] for s in samples] == [s for s in range(1, STEPS + 1) for _ in range(PROMPTS * N)]
    for s in samples:
        assert isinstance(s["prompt"], str) and s["prompt"].endswith("assistant\n")
        assert isinstance(s["response"], str)
        for key in ("score", "reward/format", "reward/answer_match", "advantage"):
            assert isinstance(s[key], float), (key, s)
        # the combined score is the weighted sum of the rewards (weights 1 and 0.5)
        assert s["score"] == pytest.approx(s["reward/format"] + 0.5 * s["reward/answer_match"])
        assert s["reward/format"] == float("7" in s["response"])
    for row in metrics:
        scores = [s["score"] for s in samples if s["step"] == row["step"]]
        assert [s["index"] for s in samples if s["step"] == row["step"]] == list(range(PROMPTS * N))
        assert row["reward/mean"] == pytest.approx(sum(scores) / len(scores), abs=1e-6)
        assert row["reward/max"] == pytest.approx(max(scores)) and row["reward/min"] == pytest.approx(min(scores))
        # GRPO: advantages are centred within each prompt's group of N responses
        group = [s for s in samples if s["step"] == row["step"]]
        for g in range(PROMPTS):
            assert len({s["prompt"] for s in group[g * N : (g + 1) * N]}) == 1
            assert sum(s["advantage"] for s in group[g * N : (g + 1) * N]) == pytest.approx(0.0, abs=1e-4)


def test_per_reward_statistics_and_training_throughput(real_run):
    _, metrics, samples = real_run
    for row in metrics:
        for name in ("format", "answer_match"):
            values = torch.tensor([s[f"reward/{name}"] for s in samples if s["step"] == row["step"]])
            assert row[f"reward/{name}/mean"] == pytest.approx(values.mean().item(), abs=1e-6)
            assert row[f"reward/{name}/std"] == pytest.approx(values.std().item(), abs=1e-6)
            assert (row[f"reward/{name}/min"], row[f"reward/{name}/max"]) == (values.min().item(), values.max().item())
        # prompt + response tokens of the step's batch through the update, per second of update time
        assert row["throughput/train_tokens_per_s"] > 0
        tokens = row["throughput/train_tokens_per_s"] * row["timing/update"]
        expected = PROMPTS * N * (row["prompt_length/mean"] + row["response_length/mean"])
        assert tokens == pytest.approx(expected, rel=1e-4)


def test_bad_metric_values_never_stop_the_jsonl_logger(tmp_path, caplog):
    import numpy as np

    logger = JSONLLogger(JSONLLogger.Options(), ctx(tmp_path))
    logger.open(total_steps=2, start_step=0)
    with caplog.at_level(logging.WARNING):
        logger.log(
            1,
            {
                "a": 1,
                "nan": float("nan"),
                "inf": -math.inf,
                "t": torch.tensor(2.5),
                "np": np.float32(0.25),
                "text": "oops",
                "vec": torch.ones(3),
                "none": None,
            },
        )
    logger.log_samples(1, [{"prompt": "p", "response": "r", "score": float("nan"), "ids": torch.tensor([1, 2])}])
    logger.close()
    row = strict_json((tmp_path / "metrics.jsonl").read_text())
    assert {k: v for k, v in row.items() if k != "time"} == {
        "step": 1,
        "a": 1.0,
        "nan": None,
        "inf": None,
        "t": 2.5,
        "np": 0.25,
        "none": None,
    }
    assert "'text'" in caplog.text and "'vec'" in caplog.text  # dropped, with a warning naming the key
    sample = strict_json((tmp_path / "samples.jsonl").read_text())
    assert sample == {"step": 1, "index": 0, "prompt": "p", "response": "r", "score": None, "ids": [1, 2]}


def test_jsonl_starts_afresh_and_appends_when_resuming(tmp_path):
    logger = JSONLLogger(JSONLLogger.Options(), ctx(tmp_path))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "x": 0.0}\n{"step": 2, "x": 0.0}\n')
    logger.open(total_steps=3, start_step=0)  # a new run owns the files
    logger.log(1, {"x": 1.0})
    logger.close()
    logger.open(total_steps=3, start_step=1)  # resumed after step 1
    logger.log(2, {"x": 2.0})
    logger.close()
    rows = [strict_json(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["x"]) for r in rows] == [(1, 1.0), (2, 2.0)]


def test_clean_metrics_keeps_numbers_only():
    assert clean_metrics({"a": True, "b": 3, "c": float("inf"), "d": [1]}) == {"a": 1.0, "b": 3.0, "c": None}


# --- console -------------------------------------------------------------------------------


def test_summary_line_is_the_one_line_per_step():
    m = {
        "reward/mean": 0.21875,
        "reward/std": 0.42,
        "actor/kl": 0.00123,
        "response_length/mean": 13.44,
        "actor/pg_loss": 0.0614,
        "timing/rollout": 4.51,
        "timing/update": 9.1,
        "timing/step": 16.24,
    }
    assert summary_line(1, 30, m) == (
        "step 1/30 | reward 0.219 ± 0.420 | kl 0.0012 | len 13.4 | loss +0.0614 | "
        "rollout 4.5s | update 9.1s | step 16.2s"
    )
    # a step that compiled says how long of it (timing/compile); one that compiled nothing says nothing
    assert summary_line(1, 30, {"timing/step": 75.8, "timing/compile": 71.6}) == (
        "step 1/30 | step 75.8s | of which compiling 71.6s"
    )
    assert summary_line(2, 30, {"timing/step": 0.4, "timing/compile": 0.0}) == "step 2/30 | step 0.4s"
    # a missing std, a NaN KL or a non-number never raise
    assert summary_line(2, 30, {"reward/mean": 0.5, "actor/kl": float("nan"), "timing/step": "x"}) == (
        "step 2/30 | reward 0.500 ± - | kl nan | step ?s"
    )


def test_console_prints_every_n_steps_and_the_last(capsys, tmp_path):
    logger = ConsoleLogger(ConsoleLogger.Options(every=2), ctx(tmp_path))
    logger.open(total_steps=3, start_step=0)  # not a terminal under pytest: plain lines, no bar
    for step in (1, 2, 3):
        logger.log(step, {"reward/mean": step / 10})
    logger.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["step 2/3 | reward 0.200 ± -", "step 3/3 | reward 0.300 ± -"]
