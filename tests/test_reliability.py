"""Checkpoints, exact resume, signals, guards and early input validation (real subprocesses)."""

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml
from hybridrl_testing import metrics_rows

from hybridrl import checkpoint as ckpt
from hybridrl.builtin.rollout_hf import HFEngine
from hybridrl.components import RewardFunction, RolloutEngine, RolloutOutput
from hybridrl.config import ConfigError, load_config
from hybridrl.errors import NonFiniteError, StageError
from hybridrl.hookspecs import hookimpl
from hybridrl.run import build_run
from hybridrl.trainer import Trainer


def config(model, run_dir, **trainer):
    return {
        "model": {"path": model},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 64},
        "rollout": {"engine": "hf", "n": 4, "max_tokens": 8},
        "rewards": [{"function": "format", "pattern": "7"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.01},
        "trainer": {
            "steps": 6,
            "prompts_per_step": 2,
            "lr": 1e-2,
            "seed": 0,
            "threads": 1,
            "run_dir": str(run_dir),
            "sample_every": 2,
            **trainer,
        },
        "logging": {"loggers": ["jsonl"]},
    }


def comparable(row):
    """A row's metrics but times and the sync check's, which runs again at the first step of a resume."""
    return {k: v for k, v in row.items() if not k.startswith(("timing/", "throughput/", "rollout/sync_check"))}


# A runner that registers a plugin which blocks in on_step_end of a chosen step, so the test
# can SIGKILL the process at a known point: after step 4 was logged, before checkpoint 6.
RUNNER = """
import sys, time, pathlib
from hybridrl import plugins
from hybridrl.hookspecs import hookimpl
from hybridrl.cli import main

class Block:
    @hookimpl
    def on_step_end(self, step):
        if step == int(sys.argv[2]):
            pathlib.Path(sys.argv[3]).write_text("here")
            time.sleep(600)

plugins.get_plugin_manager().register(Block())
sys.exit(main(["train", sys.argv[1], *sys.argv[4:]]))
"""


def test_kill_and_resume_gives_the_same_metrics(tiny_model, tmp_path):
    reference = tmp_path / "reference"
    Trainer(build_run(load_config(data=config(tiny_model, reference, save_every=3)))).train()

    run = tmp_path / "run"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(config(tiny_model, run, save_every=3)))
    marker = tmp_path / "blocked"
    proc = subprocess.Popen([sys.executable, "-c", RUNNER, str(cfg), "5", str(marker)])
    deadline = time.time() + 300
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert marker.exists(), "the run never reached step 5"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert [r["step"] for r in metrics_rows(run)] == [1, 2, 3, 4]  # step 4 logged, checkpoint only at 3
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step-000003"]

    out = subprocess.run(
        [sys.executable, "-m", "hybridrl.cli", "train", str(cfg), "--resume"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "resumed from" in out.stdout and "step-000003" in out.stdout

    resumed, expected = metrics_rows(run), metrics_rows(reference)
    assert [r["step"] for r in resumed] == list(range(1, 7))
    for got, want in zip(resumed, expected, strict=True):
        got, want = comparable(got), comparable(want)
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (got["step"], key)


def test_sigint_saves_a_checkpoint_and_exits_130(tiny_model, tmp_path):
    run = tmp_path / "run"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(config(tiny_model, run, steps=50)))
    marker = tmp_path / "blocked"
    runner = RUNNER.replace("time.sleep(600)", "import os, signal; os.kill(os.getpid(), signal.SIGINT)")
    out = subprocess.run(
        [sys.executable, "-c", runner, str(cfg), "2", str(marker)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 130, out.stderr
    assert "stopped by SIGINT after step 2" in out.stderr and "--resume" in out.stderr
    path = ckpt.latest_checkpoint(run)
    assert path.name == "step-000002"
    state = torch.load(path / "state.pt", weights_only=True)
    assert state["step"] == 2 and state["prompts"]["pos"] == 4


def test_crash_during_save_keeps_the_previous_checkpoint(tiny_model, tmp_path, monkeypatch):
    trainer = Trainer(build_run(load_config(data=config(tiny_model, tmp_path / "run", steps=2, save_every=1))))
    trainer.train()
    before = ckpt.latest_checkpoint(trainer.run.run_dir)
    assert before.name == "step-000002"

    real_save = torch.save

    def failing_save(obj, path, *a, **k):
        if str(getattr(path, "name", path)).endswith("state.pt"):  # a path, or the file it writes through
            raise OSError("disk full")
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint(trainer.run, trainer.stateful_components(), 3)
    monkeypatch.undo()
    assert ckpt.latest_checkpoint(trainer.run.run_dir) == before
    assert not list(ckpt.checkpoint_dir(trainer.run.run_dir).glob(".step-*"))  # no half-written directory
    assert ckpt.load_checkpoint(trainer.run, trainer.stateful_components(), before) == 2


def test_keep_last_rotation(tiny_model, tmp_path):
    """(``hybridrl export`` of the newest checkpoint: plugins/export/tests.)"""
    trainer = Trainer(
        build_run(load_config(data=config(tiny_model, tmp_path / "run", steps=4, save_every=1, keep_last=2)))
    )
    trainer.train()
    assert [p.name for p in ckpt.list_checkpoints(trainer.run.run_dir)] == ["step-000003", "step-000004"]


def test_the_final_checkpoint_can_keep_the_weights_alone_or_be_left_out(tiny_model, tmp_path, capfd):
    run = tmp_path / "weights"
    trainer = Trainer(build_run(load_config(data=config(tiny_model, run, steps=2, save_every=1, save_final="weights"))))
    trainer.train()
    full, final = ckpt.list_checkpoints(run)
    assert "optimizer" in torch.load(full / "optimizer.pt") and "optimizer" not in torch.load(final / "optimizer.pt")
    assert json.loads((final / "meta.json").read_text())["weights_only"] is True
    assert sum(f.stat().st_size for f in final.rglob("*")) < sum(f.stat().st_size for f in full.rglob("*"))
    # a longer run resumes from it: the policy's weights, a fresh optimizer, said once
    resumed = Trainer(build_run(load_config(data=config(tiny_model, run, steps=3, resume=True, save_final="weights"))))
    resumed.train()
    assert resumed.start_step == 2 and [r["step"] for r in metrics_rows(run)] == [1, 2, 3]
    assert "holds the policy's weights without the optimizer's state" in capfd.readouterr().err

    off = tmp_path / "off"
    Trainer(build_run(load_config(data=config(tiny_model, off, steps=2, save_final=False)))).train()
    assert ckpt.list_checkpoints(off) == [] and len(metrics_rows(off)) == 2


def test_existing_run_is_not_overwritten_without_resume(tiny_model, tmp_path):
    Trainer(build_run(load_config(data=config(tiny_model, tmp_path / "run", steps=1)))).train()
    with pytest.raises(ConfigError, match="already holds checkpoints. Continue that run with --resume"):
        build_run(load_config(data=config(tiny_model, tmp_path / "run", steps=2)))


class NaNReward(RewardFunction):
    def score(self, batch):
        return [float("nan")] + [1.0] * (len(batch) - 1)


class BrokenReward(RewardFunction):
    def score(self, batch):
        raise ConnectionError("reward server unreachable")


class EmptyEngine(RolloutEngine):
    def generate(self, prompts, sampling):
        n = len(prompts) * sampling.n
        return RolloutOutput([[] for _ in range(n)], [[] for _ in range(n)], ["stop"] * n)

    def update_weights(self, named_tensors):
        for _ in named_tensors:
            pass


class StaleEngine(HFEngine):
    """The hf engine, except that the weights it is sent never reach it (a sync that fails silently)."""

    def update_weights(self, named_tensors):
        for _ in named_tensors:
            pass


class LateStaleEngine(HFEngine):
    """The hf engine, taking the weights of its first two syncs and none after (a sync that breaks
    mid-run)."""

    def update_weights(self, named_tensors):
        self.syncs = getattr(self, "syncs", 0) + 1
        if self.syncs <= 2:
            return super().update_weights(named_tensors)
        for _ in named_tensors:
            pass


class ClosingReward(RewardFunction):
    """Counts its close() calls, as reward_hf's models and HTTP sessions release themselves there."""

    closed = 0

    def score(self, batch):
        return [0.0] * len(batch["response_text"])

    def close(self):
        type(self).closed += 1


class TestPlugins:
    @hookimpl
    def register_reward_functions(self, register):
        register("nan", NaNReward)
        register("broken", BrokenReward)
        register("closing", ClosingReward)

    @hookimpl
    def register_rollout_engines(self, register):
        register("empty", EmptyEngine)
        register("stale", StaleEngine)
        register("late-stale", LateStaleEngine)


def test_nan_reward_aborts_naming_the_reward_and_keeps_the_checkpoint(tiny_model, tmp_path, register_plugin, capfd):
    register_plugin(TestPlugins(), name="test-plugins")
    data = config(tiny_model, tmp_path / "run", steps=1)
    Trainer(build_run(load_config(data=data))).train()  # one good step and its checkpoint
    data["rewards"] = [{"function": "nan"}]
    data["trainer"]["steps"] = 3
    with pytest.raises(NonFiniteError, match=r"step 2: the combined reward is NaN/Inf.*step-000001\) is intact"):
        Trainer(build_run(load_config(data=data, overrides=["trainer.resume=true"]))).train()
    assert "reward 'nan' returned NaN/Inf for 1 responses" in capfd.readouterr().err
    assert ckpt.latest_checkpoint(tmp_path / "run").name == "step-000001"


def test_nan_reward_is_skipped_when_configured(tiny_model, tmp_path, register_plugin):
    register_plugin(TestPlugins(), name="test-plugins")
    data = config(tiny_model, tmp_path / "run", steps=2, on_nonfinite="skip")
    data["rewards"] = [{"function": "nan"}]
    trainer = Trainer(build_run(load_config(data=data)))
    before = {k: v.clone() for k, v in trainer.run.policy.state_dict().items()}  # the initial policy
    metrics = trainer.train()
    assert metrics["batch/trained_fraction"] == 0.0
    assert all(torch.equal(before[k], v) for k, v in trainer.run.policy.state_dict().items())


def test_rewards_are_closed_when_training_ends_or_fails(tiny_model, tmp_path, register_plugin):
    register_plugin(TestPlugins(), name="test-plugins")
    ClosingReward.closed = 0
    data = config(tiny_model, tmp_path / "run", steps=1)
    data["rewards"] = [{"function": "closing"}, {"function": "closing", "name": "again"}]
    Trainer(build_run(load_config(data=data))).train()
    assert ClosingReward.closed == 2
    data["rewards"].append({"function": "broken", "name": "judge"})
    data["trainer"]["run_dir"] = str(tmp_path / "failing")
    with pytest.raises(StageError):
        Trainer(build_run(load_config(data=data))).train()
    assert ClosingReward.closed == 4


def test_an_engine_that_did_not_take_the_weights_stops_the_run_after_the_sync(tiny_model, tmp_path, register_plugin):
    register_plugin(TestPlugins(), name="test-plugins")
    data = config(tiny_model, tmp_path / "run", steps=3, lr=0.1)
    data["rollout"]["engine"] = "stale"
    with pytest.raises(StageError, match=r"rollout engine 'stale' on rank\(s\) \[0\]: after the weight sync of step 1"):
        Trainer(build_run(load_config(data=data))).train()
    data["rollout"]["sync_check"] = 0  # the check off: the run goes on, off-policy
    data["trainer"]["run_dir"] = str(tmp_path / "unchecked")
    metrics = Trainer(build_run(load_config(data=data))).train()
    assert metrics["rollout/logprob_diff_mean"] > 0.01 and "rollout/sync_check_diff_max" not in metrics


@pytest.mark.parametrize("every, caught", [(1, 3), (2, 4)])
def test_the_sync_check_runs_after_the_first_sync_then_every_n(tiny_model, tmp_path, register_plugin, every, caught):
    """The engine stops taking the weights at the sync of step 3: a check every step sees it there;
    every 2 steps (after steps 1, 2, 4) at step 4."""
    register_plugin(TestPlugins(), name="test-plugins")
    data = config(tiny_model, tmp_path / "run", steps=5, lr=0.1)
    data["rollout"] |= {"engine": "late-stale", "sync_check_every": every}
    with pytest.raises(StageError, match=rf"'late-stale' on rank\(s\) \[0\]: after the weight sync of step {caught} "):
        Trainer(build_run(load_config(data=data))).train()


def test_failing_reward_is_named(tiny_model, tmp_path, register_plugin):
    register_plugin(TestPlugins(), name="test-plugins")
    data = config(tiny_model, tmp_path / "run", steps=1)
    data["rewards"] = [{"function": "broken", "name": "judge"}]
    with pytest.raises(StageError, match=r"reward 'judge' \(function 'broken'\) failed in score: ConnectionError"):
        Trainer(build_run(load_config(data=data))).train()


def test_empty_responses_do_not_break_a_step(tiny_model, tmp_path, register_plugin):
    register_plugin(TestPlugins(), name="test-plugins")
    data = config(tiny_model, tmp_path / "run", steps=2)
    data["rollout"]["engine"] = "empty"
    metrics = Trainer(build_run(load_config(data=data))).train()
    assert metrics["response_length/mean"] == 0.0 and metrics["actor/pg_loss"] == 0.0


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"data": {"source": "reasoning_gym", "task": "chain_sum", "prompt_column": "prompt"}},
            "data.prompt_column is 'prompt', but the rows have no such field. Fields: question, answer, metadata",
        ),
        (
            {"data": {"source": "reasoning_gym", "task": "chain_sum", "max_prompt_tokens": 10}},
            "more than data.max_prompt_tokens=10",
        ),
        ({"model": {"path": "/no/such/model"}}, "model.path '/no/such/model' does not exist"),
    ],
)
def test_bad_input_fails_before_any_model_is_loaded(tiny_model, tmp_path, monkeypatch, change, message):
    import hybridrl.run

    def no_models(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(hybridrl.run, "load_causal_lm", no_models)
    data = {**config(tiny_model, tmp_path / "run"), **change}
    with pytest.raises((ConfigError, FileNotFoundError), match=message):
        build_run(load_config(data=data))


def test_batch_sizes_that_do_not_divide(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.mini_batch_size=3 does not divide the 8 responses"):
        load_config(data=config(tiny_model, tmp_path, mini_batch_size=3))
    with pytest.raises(ConfigError, match=r"trainer.micro_batch_size=3 does not divide trainer.mini_batch_size=4"):
        load_config(data=config(tiny_model, tmp_path, mini_batch_size=4, micro_batch_size=3))


def test_resume_needs_a_run_dir(tiny_model):
    data = config(tiny_model, "x")
    del data["trainer"]["run_dir"]
    with pytest.raises(ConfigError, match="needs trainer.run_dir"):
        build_run(load_config(data=data, overrides=["trainer.resume=true"]))
