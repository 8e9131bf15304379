"""trainer.lr_schedule: the learning rate after the warm-up, against transformers' own schedules."""

import math

import pytest
import torch
from hybridrl_testing import SevensPlugin
from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

from hybridrl.config import ConfigError, load_config
from hybridrl.run import build_run, lr_factor
from hybridrl.trainer import Trainer


def transformers_factors(make, warmup, steps):
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = make(optimizer, warmup, steps)
    return [scheduler.lr_lambdas[0](s) for s in range(steps)]


@pytest.mark.parametrize("warmup", [0, 3])
@pytest.mark.parametrize(
    ("schedule", "make"), [("linear", get_linear_schedule_with_warmup), ("cosine", get_cosine_schedule_with_warmup)]
)
def test_decay_after_the_warm_up_is_transformers_schedule(schedule, make, warmup):
    ours = [lr_factor(warmup, 10, schedule, 0.0, s) for s in range(10)]
    theirs = transformers_factors(make, warmup, 10)
    assert ours[warmup:] == pytest.approx(theirs[warmup:])  # the decay: the same
    # the warm-up rises from 1/warmup (transformers' from 0: a first update that changes nothing)
    assert ours[:warmup] == pytest.approx([(s + 1) / warmup for s in range(warmup)])


def test_min_lr_ratio_is_where_the_decay_ends_and_constant_stays():
    # by hand: 4 steps, no warm-up, linear to 0.2: 1, 0.8, 0.6, 0.4 of lr (progress s / 4)
    assert [lr_factor(0, 4, "linear", 0.2, s) for s in range(4)] == pytest.approx([1.0, 0.8, 0.6, 0.4])
    assert lr_factor(0, 2, "cosine", 0.5, 1) == pytest.approx(0.5 + 0.5 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert [lr_factor(2, 5, "constant", 0.3, s) for s in range(5)] == [0.5, 1.0, 1.0, 1.0, 1.0]


def test_a_run_logs_the_decaying_learning_rate(tiny_model, tmp_path, register_plugin):
    register_plugin(SevensPlugin(), name="sevens")
    data = {
        "model": {"path": tiny_model},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 16},
        "rollout": {"engine": "hf", "n": 2, "max_tokens": 4},
        "rewards": [{"function": "sevens"}],
        "trainer": {"steps": 3, "prompts_per_step": 2, "lr": 0.3, "lr_schedule": "linear", "run_dir": str(tmp_path)},
        "logging": {"loggers": ["jsonl"]},
    }
    metrics = []
    trainer = Trainer(build_run(load_config(data=data)))
    trainer.log = lambda step, m, batch: metrics.append(m) or m
    trainer.train()
    assert [m["actor/lr"] for m in metrics] == pytest.approx([0.3, 0.2, 0.1])


def test_serve_keeps_a_constant_learning_rate():
    from hybridrl_serve.server import check_config

    cfg = load_config(
        data={
            "model": {"path": "unused"},
            "data": {"source": "reasoning_gym", "task": "chain_sum"},
            "rewards": [{"function": "user_rating"}],
            "trainer": {"lr_schedule": "cosine"},
        }
    )
    with pytest.raises(ConfigError, match="hybridrl serve trains for as long as it serves: set trainer.lr_schedule"):
        check_config(cfg)
