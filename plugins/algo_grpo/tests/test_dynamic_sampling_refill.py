"""DAPO dynamic sampling with refill (``rollout.refill_rounds``): the trainer draws more prompts
until ``prompts_per_step`` groups survive the filter, and trains on exactly that many."""

from hybridrl_testing import metrics_rows

from hybridrl.components import RewardFunction
from hybridrl.config import load_config
from hybridrl.hookspecs import hookimpl
from hybridrl.run import build_run
from hybridrl.trainer import Trainer

PROMPTS, N, STEPS = 4, 4, 3


class HalfFlat(RewardFunction):
    """Every response to a question with an even answer scores 1 (a uniform group, which the
    filter drops); responses to the others score their length (varied)."""

    def score(self, batch):
        return [1.0 if int(a) % 2 == 0 else float(len(t)) for a, t in zip(batch["answer"], batch["response_text"])]


class HalfFlatPlugin:
    @hookimpl
    def register_reward_functions(self, register):
        register("half_flat", HalfFlat)


def run(tiny_model, run_dir, refill_rounds: int) -> list[dict]:
    cfg = {
        "model": {"path": tiny_model},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 200},
        "rollout": {"engine": "hf", "n": N, "max_tokens": 8, "refill_rounds": refill_rounds},
        "rewards": [{"function": "half_flat"}],
        "algorithm": {"name": "grpo", "dynamic_sampling": True},
        "trainer": {"steps": STEPS, "prompts_per_step": PROMPTS, "lr": 1e-3, "seed": 0, "run_dir": str(run_dir)},
        "logging": {"loggers": ["jsonl"]},
    }
    Trainer(build_run(load_config(data=cfg))).train()
    return metrics_rows(run_dir)


def trained_responses(row) -> int:
    return round(row["batch/trained_fraction"] * row["rollout/rounds"] * PROMPTS * N)


def test_refill_trains_on_a_full_batch_of_varied_groups(tiny_model, tmp_path, register_plugin):
    register_plugin(HalfFlatPlugin(), name="half_flat")
    plain = run(tiny_model, tmp_path / "plain", refill_rounds=0)
    refill = run(tiny_model, tmp_path / "refill", refill_rounds=6)

    assert [r["rollout/rounds"] for r in plain] == [1] * STEPS
    assert any(trained_responses(r) < PROMPTS * N for r in plain)  # the filter left less than a batch
    assert all(r["batch/trained_fraction"] > 0 for r in plain)
    assert max(r["rollout/rounds"] for r in refill) > 1  # refill happened
    assert [trained_responses(r) for r in refill] == [PROMPTS * N] * STEPS  # exactly prompts_per_step groups
    # the filter saw every round: at least the trained groups survived it, out of all the rounds' groups
    for r in refill:
        assert r["dynamic_sampling/kept_groups"] >= PROMPTS
        assert r["dynamic_sampling/kept_fraction"] == r["dynamic_sampling/kept_groups"] / (
            r["rollout/rounds"] * PROMPTS
        )
