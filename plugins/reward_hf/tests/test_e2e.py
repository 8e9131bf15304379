"""End to end: GRPO on the tiny policy with a rule reward and a model reward combined with weights."""

import json
from pathlib import Path

import pytest
import torch
from hybridrl_testing import metrics_rows

from hybridrl.config import load_config
from hybridrl.run import build_run
from hybridrl.trainer import Trainer

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "grpo_smollm2_rm.yaml"


def test_grpo_with_a_rule_and_a_model_reward(tiny_model, minilm, tmp_path, make_reward, make_batch):
    run = tmp_path / "run"
    cfg = load_config(
        data={
            "model": {"path": tiny_model},
            "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 16},
            "rollout": {"engine": "hf", "n": 4, "max_tokens": 8},
            "rewards": [
                {"function": "format", "pattern": "\\d", "weight": 1.0},
                {"function": "embedding_similarity", "model": minilm, "name": "similarity", "weight": 0.5},
            ],
            "algorithm": {"name": "grpo"},
            "trainer": {
                "steps": 2,
                "prompts_per_step": 2,
                "lr": 1e-3,
                "seed": 0,
                "run_dir": str(run),
                "sample_every": 1,
            },
            "logging": {"loggers": ["jsonl"]},
        }
    )
    Trainer(build_run(cfg)).train()

    rows = metrics_rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:  # each reward logged on its own, the total combined with the weights
        assert row["reward/mean"] == pytest.approx(row["reward/format/mean"] + 0.5 * row["reward/similarity/mean"])
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 16
    similarity = make_reward("embedding_similarity", model=minilm)
    expected = similarity.score(
        make_batch(["q"] * 16, [s["response"] for s in samples], [s["answer"] for s in samples])
    )
    got = torch.tensor([s["reward/similarity"] for s in samples])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)  # the model reward scored these very texts
    assert got.std() > 0.01
    for s in samples:
        assert s["score"] == pytest.approx(s["reward/format"] + 0.5 * s["reward/similarity"], abs=1e-6)


def test_the_example_config_is_valid():
    cfg = load_config(EXAMPLE)
    assert [(r.function, r.weight) for r in cfg.rewards] == [("reasoning_gym", 1.0), ("embedding_similarity", 0.2)]
    assert [r.label for r in cfg.rewards] == ["correct", "similarity"]
