"""DAPO dynamic sampling under ``rollout.async``: the filter runs on the prefetch thread, steps ahead
of the update, and its ``dynamic_sampling/*`` metrics must still be logged with the step whose
batch they describe (they travel with the batch, as ``filter_batch``'s second result)."""

from hybridrl_testing import metrics_rows

from hybridrl.builtin.rollout_hf import HFEngine
from hybridrl.components import RewardFunction
from hybridrl.config import load_config
from hybridrl.hookspecs import hookimpl
from hybridrl.run import build_run
from hybridrl.trainer import Trainer

PROMPTS, N, STEPS = 4, 2, 4


class ApartHF(HFEngine):
    """The hf engine, declared apart from training so that rollout.async prefetches with it (its
    model is its own copy of the policy, updated only between generations)."""

    def runs_apart(self):
        return True


class StepGroups(RewardFunction):
    """Call k varies the scores of the first k groups and gives the others one score each, which
    the filter drops: the rollout of step k keeps k groups (one call per step, in step order,
    whichever thread makes it)."""

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.calls = 0

    def score(self, batch):
        self.calls += 1
        return [float(i % N) if i // N < self.calls else 1.0 for i in range(len(batch["response_text"]))]


class Plugin:
    @hookimpl
    def register_rollout_engines(self, register):
        register("hf_apart", ApartHF)

    @hookimpl
    def register_reward_functions(self, register):
        register("step_groups", StepGroups)


def test_kept_groups_are_logged_with_the_step_that_trains_on_them(tiny_model, tmp_path, register_plugin):
    register_plugin(Plugin(), name="dynamic_sampling_async")
    run_dir = tmp_path / "run"
    cfg = {
        "model": {"path": tiny_model},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 200},
        # async 2: the sync of step 1 waits until steps 2 and 3 are generated and filtered
        "rollout": {"engine": "hf_apart", "n": N, "max_tokens": 8, "async": 2},
        "rewards": [{"function": "step_groups"}],
        "algorithm": {"name": "grpo", "dynamic_sampling": True},
        "trainer": {"steps": STEPS, "prompts_per_step": PROMPTS, "lr": 1e-3, "seed": 0, "run_dir": str(run_dir)},
        "logging": {"loggers": ["jsonl"]},
    }
    Trainer(build_run(load_config(data=cfg))).train()
    rows = metrics_rows(run_dir)

    assert all("rollout/staleness_max" in r for r in rows)  # the batches came from the prefetcher
    assert [r["dynamic_sampling/kept_groups"] for r in rows] == [1.0, 2.0, 3.0, 4.0]
    assert [r["dynamic_sampling/kept_fraction"] for r in rows] == [k / PROMPTS for k in (1, 2, 3, 4)]
    # and the step trained on those groups
    assert [round(r["batch/trained_fraction"] * PROMPTS) for r in rows] == [1, 2, 3, 4]
