"""End to end: each GRPO-family variant raises the reward of a learnable task on a tiny model.

The real trainer, the tiny random Llama of ``hybridrl_testing`` and a reward registered in
the test (the fraction of '7' characters in the response, which a tiny model learns in a
few steps at a high learning rate). Plain GRPO is covered by the core's tests/test_e2e.py.
"""

import pytest
from hybridrl_testing import SevensPlugin, metrics_rows

from hybridrl.config import load_config
from hybridrl.run import build_run
from hybridrl.trainer import Trainer

STEPS = 8


VARIANTS = {
    "rloo": {"estimator": "rloo"},
    "reinforce_plus_plus": {"estimator": "reinforce_plus_plus", "kl_coef": 0.001},
    "reinforce_plus_plus_baseline": {
        "estimator": "reinforce_plus_plus_baseline",
        "loss_agg_mode": "seq-mean-token-mean",
    },
    "dr_grpo": {"norm_adv_by_std": False, "loss_agg_mode": "seq-mean-token-sum-norm"},
    "gspo": {"policy_loss": "gspo"},
    "dapo": {
        "clip_low": 0.2,
        "clip_high": 0.28,
        "dynamic_sampling": True,
        "overlong_buffer_len": 4,
        "overlong_max_length": 12,
        "overlong_penalty_factor": 0.1,
        "entropy_coeff": 0.001,
    },
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_learns(variant, tiny_model, tmp_path, register_plugin):
    register_plugin(SevensPlugin(), name="sevens")
    run_dir = tmp_path / "run"
    cfg = {
        "model": {"path": tiny_model},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 64},
        "rollout": {"engine": "hf", "n": 8, "max_tokens": 12},
        "rewards": [{"function": "sevens"}],
        "algorithm": {"name": "grpo", **VARIANTS[variant]},
        "trainer": {"steps": STEPS, "prompts_per_step": 4, "lr": 1e-2, "seed": 0, "run_dir": str(run_dir)},
        "logging": {"loggers": ["jsonl"]},
    }
    Trainer(build_run(load_config(data=cfg))).train()

    rows = metrics_rows(run_dir)
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert len(rows) == STEPS
    if variant == "dapo":
        # it learns two things at once: more sevens, and shorter responses (the overlong penalty)
        assert last > first + 0.05, f"reward did not rise: {rewards}"
        overlong = [r["reward/overlong_fraction"] for r in rows]
        assert sum(overlong[-3:]) / 3 < sum(overlong[:3]) / 3 - 0.1, f"responses did not shorten: {overlong}"
        kept = [r.get("dynamic_sampling/kept_fraction", 0.0) for r in rows]
        assert min(kept) < 1.0, f"no group was ever dropped: {kept}"  # dynamic sampling was active
    else:
        assert last > first + 0.1, f"{variant}: reward did not rise: {rewards}"
    if variant == "gspo":
        assert rows[-1]["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)  # one on-policy update per step
    if "kl_coef" in VARIANTS[variant]:
        assert rows[-1]["actor/kl"] > 0
