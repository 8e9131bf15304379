"""End to end: PPO's critic learns the value of a prompt, and critic-free PPO raises the reward.

The real trainer and the tiny random Llama of ``hybridrl_testing``; rewards registered in the
test. For the critic, two prompts are worth 0 and 1 on top of a learnable part (the fraction
of '7' in the response): a critic that reads the prompt explains most of the return variance,
one that does not explains none.
"""

import json

from hybridrl_testing import SevensReward, metrics_rows

from hybridrl.components import RewardFunction
from hybridrl.config import load_config
from hybridrl.hookspecs import hookimpl
from hybridrl.run import build_run
from hybridrl.trainer import Trainer


class PromptWorth(RewardFunction):
    """The answer column (0 or 1) of the prompt: what a critic can learn from the prompt alone."""

    def score(self, batch):
        return [float(a) for a in batch["answer"]]


class Rewards:
    @hookimpl
    def register_reward_functions(self, register):
        register("sevens", SevensReward)
        register("prompt_worth", PromptWorth)


def config(model, run_dir, algorithm, steps, **data):
    return {
        "model": {"path": model},
        "data": data or {"source": "reasoning_gym", "task": "chain_sum", "size": 64},
        "rollout": {"engine": "hf", "n": 8, "max_tokens": 12},
        "rewards": [{"function": "sevens"}],
        "algorithm": {"name": "ppo", **algorithm},
        "trainer": {"steps": steps, "prompts_per_step": 4, "lr": 1e-2, "seed": 0, "run_dir": str(run_dir)},
        "logging": {"loggers": ["jsonl"]},
    }


def test_critic_learns_and_adaptive_kl_moves(tiny_model, tmp_path, register_plugin):
    register_plugin(Rewards(), name="rewards")
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": q, "answer": str(i % 2)}) + "\n"
            for i, q in enumerate(["blue sky", "red apple"] * 16)
        )
    )
    algorithm = {
        "critic_lr": 3e-3,  # 1e-2 diverged on some seeds (value loss x5, then the mean everywhere)
        "critic_epochs": 8,
        "critic_mini_batch_size": 16,
        "critic_micro_batch_size": 8,
        "use_kl_in_reward": True,
        "kl_ctrl": "adaptive",
        "kl_coef": 0.01,
        "kl_target": 0.01,
        "kl_horizon": 100,
        "entropy_coeff": 0.001,
    }
    cfg = config(tiny_model, tmp_path / "run", algorithm, 10, source="hf", path="json", data_files=str(data))
    cfg["rewards"] = [{"function": "prompt_worth"}, {"function": "sevens"}]
    trainer = Trainer(build_run(load_config(data=cfg)))
    trainer.train()

    rows = metrics_rows(tmp_path / "run")
    ev = [r["critic/explained_var"] for r in rows]
    loss = [r["critic/value_loss"] for r in rows]
    assert abs(ev[0]) < 0.05, ev  # the zero-initialised head predicts 0 everywhere
    assert sum(ev[-3:]) / 3 > 0.7, f"the critic did not learn: explained variance {ev}"
    assert loss[-1] < loss[0] / 5, f"value loss did not fall: {loss}"
    for key in ("critic/vf_clipfrac", "critic/grad_norm", "actor/reward_kl_penalty", "actor/entropy_loss"):
        assert key in rows[-1], key
    # the policy drifts from the reference by more than the 0.01 target: beta rises every step
    betas = [r["actor/reward_kl_penalty_coeff"] for r in rows]
    assert betas[0] == 0.01 and betas[-1] > betas[0], betas
    assert trainer.run.algorithm.state_dict()["kl_coef"] > betas[-1]  # updated after the last step


def test_critic_free_ppo_learns(tiny_model, tmp_path, register_plugin):
    register_plugin(Rewards(), name="rewards")
    algorithm = {"critic": False, "baseline": "group_mean", "use_kl_loss": True, "kl_loss_coef": 0.001}
    trainer = Trainer(build_run(load_config(data=config(tiny_model, tmp_path / "run", algorithm, 8))))
    trainer.train()

    rows = metrics_rows(tmp_path / "run")
    rewards = [r["reward/mean"] for r in rows]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, f"reward did not rise: {rewards}"
    assert rows[-1]["actor/kl_loss"] > 0
    assert trainer.run.algorithm.critic is None and not any(k.startswith("critic/") for k in rows[-1])
