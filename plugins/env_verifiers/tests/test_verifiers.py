"""A verifiers 0.4 environment, unchanged, trained through the agent gateway: its taskset as the data,
its harness's two calls as one token-exact trajectory, its rubric's reward; and bad input named.

verifiers runs in the interpreter of ``.venv-verifiers`` (``make install-test`` makes it: verifiers
pins openai<3, the agent frameworks' tests need openai 3), or ``$HYBRIDRL_VERIFIERS_PYTHON``."""

import os
import re
from pathlib import Path

import pytest

from hybridrl.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[3]
PYTHON = os.environ.get("HYBRIDRL_VERIFIERS_PYTHON") or str(ROOT / ".venv-verifiers" / "bin" / "python")
ENVS = Path(__file__).parent / "vf_envs"  # the environment's package, found by verifiers by its id


def run_config(model, run_dir, taskset="sum-check"):
    vf = {"config": {"taskset": {"id": taskset, "num_tasks": 4}}, "python": PYTHON, "env": {"PYTHONPATH": str(ENVS)}}
    agent = {"environment": "verifiers", "timeout_s": 120, "max_total_tokens": 512, "concurrency": 4}
    return {
        "model": {"path": model},
        "data": {"source": "verifiers", **vf},
        "rollout": {"n": 2, "max_tokens": 12, "agent": agent | vf},
        "rewards": [{"function": "posted"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.01},
        "trainer": {"steps": 2, "prompts_per_step": 2, "lr": 1e-2, "run_dir": str(run_dir)},
        "logging": {"loggers": ["jsonl"]},
    }


@pytest.fixture(scope="module", autouse=True)
def verifiers_python():
    if not Path(PYTHON).exists():
        pytest.fail(
            f"no interpreter with verifiers at {PYTHON}: run make install-test (or set HYBRIDRL_VERIFIERS_PYTHON)"
        )


def rubric(text: str, answer: int) -> float:
    """The environment's rubric, as its Task writes it: correct (1) + has_digit (0.5)."""
    numbers = re.findall(r"-?\d+", text)
    return float(bool(numbers) and int(numbers[-1]) == answer) + 0.5 * bool(re.search(r"\d", text))


def test_grpo_trains_on_a_verifiers_environment_unchanged(tiny_model, tmp_path):
    from hybridrl.run import build_run
    from hybridrl.trainer import Trainer

    run = build_run(load_config(data=run_config(tiny_model, tmp_path / "run")))
    assert len(run.data) == 4 and run.data[1]["prompt"] == [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 3 + 3?"},
    ]
    batch = run.rollout.generate(1)
    for i, episode in enumerate(batch["episode"]):
        assert episode["lost"] is None and episode["calls"] == 2
        answer = 2 + batch["row"][i]["idx"] + 3
        assert episode["reward"] == rubric(batch["response_text"][i], answer)  # verifiers' own scoring
    # its harness's second call extends its first: one trajectory, the first reply's ids as sampled
    assert all(info["forks"] == 0 for info in batch["agent_info"])
    assert all(0 in mask.tolist() for mask in batch["response_mask"])  # the check's message between turns
    metrics = Trainer(run).train()
    assert metrics["agent/calls_mean"] == 2 and metrics["agent/lost_mean"] == 0
    assert metrics["agent/reward_posted_mean"] == 1
    assert metrics["rollout/logprob_diff_max"] < 1e-4  # engine and trainer agree on every sampled token


def test_a_verifiers_environment_that_cannot_load_is_named(tiny_model, tmp_path):
    from hybridrl.run import build_run

    with pytest.raises(ConfigError, match=r"verifiers: cannot list the tasks of .*no-such-env.*not found"):
        build_run(load_config(data=run_config(tiny_model, tmp_path / "run", taskset="no-such-env")))
    cfg = run_config(tiny_model, tmp_path / "run")
    cfg["data"]["python"] = str(tmp_path / "nowhere" / "python")
    with pytest.raises(ConfigError, match="verifiers: python '.*nowhere/python' does not exist"):
        build_run(load_config(data=cfg))
    cfg = run_config(tiny_model, tmp_path / "run")
    cfg["rollout"]["agent"]["command"] = "python agent.py"
    with pytest.raises(ConfigError, match="runs the environment's own agent: remove command/callable"):
        load_config(data=cfg)
