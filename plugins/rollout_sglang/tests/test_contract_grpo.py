"""GRPO with ``rollout.engine: sglang`` through the real trainer: contract tests.

SGLang is the contract fake (conftest.py) backed by the tiny transformers model: over HTTP
in server mode, and as the ``sglang`` module in-process. The trainer, GRPO, the weight sync
and the learnable reward are real.
"""

from hybridrl_testing import SevensPlugin, metrics_rows

from hybridrl.config import load_config
from hybridrl.run import build_run
from hybridrl.trainer import Trainer


def config(model, run_dir, rollout, steps):
    return {
        "model": {"path": model},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 64},
        "rollout": {"engine": "sglang", "n": 8, "max_tokens": 12, **rollout},
        "rewards": [{"function": "sevens"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.001},
        "trainer": {
            "steps": steps,
            "prompts_per_step": 4,
            "lr": 1e-2,
            "seed": 0,
            "device": "cpu",
            "run_dir": str(run_dir),
        },
        "logging": {"loggers": ["jsonl"]},
    }


def test_grpo_learns_against_an_sglang_server(tiny_model, tmp_path, sglang_server, register_plugin):
    """Contract test: server mode end to end; the reward rises and every step syncs the weights."""
    register_plugin(SevensPlugin(), name="sevens")
    run = tmp_path / "run"
    cfg = load_config(data=config(tiny_model, run, {"base_url": sglang_server.url, "batch_size": 16}, steps=12))
    Trainer(build_run(cfg)).train()

    rows = metrics_rows(run)
    rewards = [r["reward/mean"] for r in rows]
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.15, f"reward did not rise: {rewards}"
    # the server generated with the weights the trainer had: the sync after every step arrived
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-3
    paths = [p for p, _ in sglang_server.requests]
    # per step: the rollout (two batches of 16); the probe of rollout.sync_check before the first
    # update and after the syncs of steps 1 and 10 (the first sync, then every sync_check_every steps)
    assert paths.count("/update_weights_from_disk") == 12 and paths.count("/generate") == 12 * 2 + 3
    assert sorted(p.name for p in (run / "sglang_weights").iterdir()) == ["v000012"]


def test_grpo_in_process_releases_and_reloads_around_training(tiny_model, tmp_path, sglang_module, register_plugin):
    """Contract test: in-process engine; each step releases memory for training and reloads weights."""
    register_plugin(SevensPlugin(), name="sevens")
    run = tmp_path / "run"
    data = config(tiny_model, run, {"update_bucket_mb": 0.1, "sync_check_every": 1}, steps=3)
    Trainer(build_run(load_config(data=data))).train()

    rows = metrics_rows(run)
    assert len(rows) == 3 and max(r["rollout/logprob_diff_max"] for r in rows) < 1e-3
    engine = sglang_module.Engine.last
    calls = [c[0] if c[0] in ("generate", "update_weights_from_tensor") else (c[0], *c[1]) for c in engine.core.calls]
    k = len(engine.tensor_calls) // 3  # buckets per update
    assert k >= 2 and len(engine.tensor_calls) == 3 * k
    step = ["generate", ("release", "cuda_graph", "kv_cache", "weights"), ("resume", "weights")]
    step += ["update_weights_from_tensor"] * k
    # after each sync the probe of rollout.sync_check generates, which resumes the caches
    step += [("resume", "cuda_graph", "kv_cache"), "generate"]
    assert calls == ["generate"] + step * 3  # first the probe before any update (rollout.sync_check)
    assert engine.is_shutdown
