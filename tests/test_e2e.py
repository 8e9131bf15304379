"""End to end: the real trainer, a tiny random model, a learnable reward registered in-test."""

import gc
import json
import subprocess
import sys

import pytest
import torch
from hybridrl_testing import SevensPlugin, metrics_rows

from hybridrl.config import load_config
from hybridrl.hookspecs import hookimpl
from hybridrl.run import build_run
from hybridrl.trainer import Trainer


class StepRecorder:
    def __init__(self):
        self.steps, self.started, self.ended = [], False, False

    @hookimpl
    def on_train_start(self, run):
        self.started = True

    @hookimpl
    def on_step_end(self, step, metrics, batch):
        metrics["test/extra"] = float(step)
        self.steps.append((step, len(batch)))

    @hookimpl
    def on_train_end(self, metrics):
        self.ended = True


def tiny_config(model, run_dir, **trainer):
    return {
        "model": {"path": model},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 64, "chat_template": True},
        "rollout": {"engine": "hf", "n": 8, "max_tokens": 12},
        "rewards": [{"function": "sevens"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.001},
        "trainer": {
            "steps": 12,
            "prompts_per_step": 4,
            "lr": 1e-2,
            "seed": 0,
            "run_dir": str(run_dir),
            "sample_every": 4,
            **trainer,
        },
        "logging": {"loggers": ["jsonl"]},
    }


def test_grpo_learns_a_simple_reward(tiny_model, tmp_path, register_plugin):
    register_plugin(SevensPlugin(), name="sevens")
    recorder = register_plugin(StepRecorder(), name="recorder")
    cfg = load_config(data=tiny_config(tiny_model, tmp_path / "run"))
    Trainer(build_run(cfg)).train()

    rows = metrics_rows(tmp_path / "run")
    rewards = [r["reward/mean"] for r in rows]
    assert [r["step"] for r in rows] == list(range(1, 13))
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.15, f"reward did not rise: {rewards}"
    # every step logs the core metrics, the hook's addition and the engine/trainer mismatch
    for key in (
        "reward/std",
        "actor/kl",
        "actor/grad_norm",
        "response_length/mean",
        "timing/rollout",
        "timing/update",
        "timing/sync",
        "rollout/logprob_diff_mean",
        "test/extra",
    ):
        assert key in rows[-1], key
    assert rows[-1]["rollout/logprob_diff_mean"] < 1e-3  # the engine got the updated weights each step
    assert recorder.started and recorder.ended and recorder.steps[0] == (1, 32)
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {4, 8, 12} and "reward/sevens" in samples[0]


class FreezeRecorder:
    def __init__(self):
        self.frozen = []

    @hookimpl
    def on_step_end(self, step, metrics, batch):
        self.frozen.append(gc.get_freeze_count())


def test_the_run_freezes_its_heap_at_start_and_after_step_1_and_logs_each_steps_collections(
    tiny_model, tmp_path, register_plugin
):
    register_plugin(SevensPlugin(), name="sevens")
    recorder = register_plugin(FreezeRecorder(), name="freeze-recorder")
    cfg = load_config(data=tiny_config(tiny_model, tmp_path / "run", steps=3))
    Trainer(build_run(cfg)).train()

    first, second, *later = recorder.frozen
    assert first > 10_000  # torch, transformers, the models: frozen when the run starts
    assert second > first and all(n <= second for n in later)  # and what step 1 made, once (frozen ones may die)
    assert gc.get_freeze_count() == 0  # and given back when the run ends
    rows = metrics_rows(tmp_path / "run")
    for row in rows:
        assert 0.0 <= row["timing/gc_longest"] <= row["timing/gc"] < row["timing/step"]


def test_several_updates_per_step_use_old_logprobs(tiny_model, tmp_path, register_plugin):
    register_plugin(SevensPlugin(), name="sevens")
    cfg = load_config(
        data=tiny_config(tiny_model, tmp_path / "run", steps=2, mini_batch_size=16, micro_batch_size=8, epochs=2)
    )
    metrics = Trainer(build_run(cfg)).train()
    assert metrics["actor/ppo_kl"] != 0.0  # the second minibatch sees a policy that moved
    assert metrics["rollout/logprob_diff_mean"] < 1e-4  # old logprobs computed before any update


def test_cli_train_runs_and_writes_the_run_dir(tiny_model, tmp_path):
    import yaml

    cfg = tiny_config(tiny_model, tmp_path / "run", steps=2)
    cfg["rewards"] = [{"function": "format", "pattern": "7"}]
    cfg["logging"] = {"loggers": ["console", "jsonl"]}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = subprocess.run(
        [sys.executable, "-m", "hybridrl.cli", "train", str(path), "trainer.steps=2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "step 1/2 | reward" in out.stdout and "step 2/2 | reward" in out.stdout
    assert (tmp_path / "run" / "config.yaml").is_file()
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


def test_cli_errors_are_one_line_with_exit_code_2(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(
        "model: {path: /no/such/model}\nrewards: [{function: answer_match}]\n"
        "data: {source: reasoning_gym, task: chain_sum}\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "hybridrl.cli", "validate", str(path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2
    assert "model.path '/no/such/model' does not exist" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "hybridrl.cli", "train", str(path), "rollout.engine=vlm"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "Unknown rollout engine 'vlm'" in out.stderr


@pytest.mark.parametrize("device", ["cuda"])
def test_unavailable_device_is_named(device, tiny_model, tmp_path, register_plugin):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    register_plugin(SevensPlugin(), name="sevens")
    cfg = load_config(data=tiny_config(tiny_model, tmp_path / "run", device=device))
    with pytest.raises(ValueError, match="trainer.device is 'cuda', but torch sees no CUDA device"):
        build_run(cfg)
