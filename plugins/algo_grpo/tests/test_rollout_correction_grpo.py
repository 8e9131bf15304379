"""GRPO with off-policy correction: the loss against hand-computed values, the options' errors, and
end to end with an engine that really samples from another distribution than the trainer scores.

The built-in hf engine records each token's logprob under the full temperature-scaled distribution,
the trainer's: with it the weights are 1. The engine of these tests (``hf_sampled``) records the
logprob of the distribution it sampled from, after top-p, as vLLM does; with ``top_p < 1`` each
token's ratio pi_old / pi_rollout is then the probability mass of the nucleus it was drawn from,
below 1, and in bfloat16 it also scatters both ways around 1, as a bfloat16 vLLM does.
"""

import math

import pytest
import torch
from hybridrl_testing import SevensPlugin, metrics_rows

from hybridrl import plugins
from hybridrl.batch import Batch
from hybridrl.builtin.rollout_hf import HFEngine
from hybridrl.config import ConfigError, load_config
from hybridrl.hookspecs import hookimpl
from hybridrl.run import build_run
from hybridrl.trainer import Trainer

MASK = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]])  # a hole at t = 2 of row 0; padding in row 1


def grpo(**options):
    GRPO = plugins.lookup("algorithm", "grpo")
    return GRPO(GRPO.Options(**options), ctx=None)


def loss_batch(ratios):
    """old logprobs 0; the engine's -log(ratio) on valid tokens, so that pi_old / pi_rollout = ratio;
    at the hole the engine's logprob is -inf (it never sampled the observation token)."""
    b = Batch()
    b["response_mask"] = MASK
    b["old_logprobs"] = torch.zeros(2, 4)
    b["rollout_logprobs"] = torch.tensor([[-math.log(r) if r else 0.0 for r in row] for row in ratios])
    b["rollout_logprobs"][0, 2] = float("-inf")
    b["advantages"] = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-2.0, -2.0, 0.0, 0.0]])
    b["ref_logprobs"] = torch.full((2, 4), -1.0)
    return b


def test_vanilla_loss_weighs_each_token_and_leaves_kl_and_entropy_alone():
    algo = grpo(rollout_correction="token", rollout_correction_cap=2.0, kl_coef=0.5, kl_kind="k2", entropy_coeff=0.1)
    b = loss_batch([[3.0, 0.5, None, 1.5], [0.25, 1.2, None, None]])
    logp = torch.zeros(2, 4, requires_grad=True)  # ratio to old 1: nothing clipped
    loss, m = algo.loss(b, logp, torch.full((2, 4), 2.0))
    w = torch.tensor([[2.0, 0.5, 0.0, 1.5], [0.25, 1.2, 0.0, 0.0]])  # min(ratio, 2); 0 at the hole and padding
    pg = (-(b["advantages"] * w * MASK).sum() / 5).item()  # token-mean over the 5 valid tokens
    # k2 KL to the reference: 0.5 (0 - (-1))^2 = 0.5 on every token, unweighted; entropy 2, unweighted
    assert m["actor/pg_loss"] == pytest.approx(pg, rel=1e-6)
    assert pg == pytest.approx(-(2 + 0.5 + 1.5 - 0.5 - 2.4) / 5)
    assert loss.item() == pytest.approx(pg - 0.1 * 2.0 + 0.5 * 0.5, rel=1e-6)
    assert float(m["rollout_corr/weight_mean"]) == pytest.approx((2 + 0.5 + 1.5 + 0.25 + 1.2) / 5, rel=1e-6)
    assert float(m["rollout_corr/truncated_fraction"]) == pytest.approx(1 / 5)
    loss.backward()
    # pg: -A w / 5 per valid token; k2: 0.5 x (logp - ref) / 5 = 0.5 / 5 per valid token
    expected = (-b["advantages"] * w + 0.5) * MASK / 5
    torch.testing.assert_close(logp.grad, expected, rtol=1e-6, atol=1e-7)


def test_gspo_with_sequence_correction_weighs_whole_responses():
    algo = grpo(policy_loss="gspo", rollout_correction="sequence", rollout_correction_cap=2.0)
    b = loss_batch([[3.0, 0.5, None, 1.5], [0.25, 1.2, None, None]])  # products 2.25 -> 2 (capped), 0.3
    logp = torch.zeros(2, 4, requires_grad=True)
    loss, m = algo.loss(b, logp, torch.zeros(2, 4))
    # seq-mean-token-mean: (1/2) sum_i mean_t (-A_i w_i); s_i = 1
    assert loss.item() == pytest.approx((-1.0 * 2.0 + 2.0 * 0.3) / 2, rel=1e-6)
    assert float(m["rollout_corr/truncated_fraction"]) == pytest.approx(3 / 5)  # row 0's three tokens
    loss.backward()
    # GSPO-token: d s_i,t / d logp_t = s_i = 1, so each token's gradient is -A_i w_i / (N |y_i|), N = 2
    expected = torch.tensor([[-2.0 / 6, -2.0 / 6, 0.0, -2.0 / 6], [0.6 / 4, 0.6 / 4, 0.0, 0.0]])
    torch.testing.assert_close(logp.grad, expected, rtol=1e-6, atol=1e-7)


def test_masked_tokens_drop_out_but_still_count_in_the_normaliser():
    algo = grpo(rollout_mask="token", rollout_mask_low=0.5, rollout_mask_high=2.0)
    b = loss_batch([[3.0, 0.5, None, 1.5], [0.25, 1.2, None, None]])  # 3 and 0.25 masked
    loss, m = algo.loss(b, torch.zeros(2, 4), torch.zeros(2, 4))
    assert loss.item() == pytest.approx(-(0.0 + 1 + 1 - 0.0 - 2) / 5)  # kept: A = 1, 1, -2; over 5 tokens
    assert float(m["rollout_corr/masked_fraction"]) == pytest.approx(2 / 5)


def test_off_the_loss_is_unchanged():
    b = loss_batch([[3.0, 0.5, None, 1.5], [0.25, 1.2, None, None]])
    loss, m = grpo().loss(b, torch.zeros(2, 4), torch.zeros(2, 4))
    assert loss.item() == pytest.approx(-(1 + 1 + 1 - 2 - 2) / 5)
    assert not any(k.startswith("rollout_corr/") for k in m)


def config(model, run_dir, algorithm, rollout, steps=10, **trainer):
    return {
        "model": {"path": model},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 64},
        "rollout": {"n": 8, "max_tokens": 12, **rollout},
        "rewards": [{"function": "sevens"}],
        "algorithm": {"name": "grpo", **algorithm},
        "trainer": {"steps": steps, "prompts_per_step": 4, "lr": 1e-2, "seed": 0, "run_dir": str(run_dir), **trainer},
        "logging": {"loggers": ["jsonl"]},
    }


@pytest.mark.parametrize(
    "options, message",
    [
        ({"rollout_correction_cap": 0.5}, "algorithm.rollout_correction_cap: Value error, must be above 1"),
        ({"rollout_mask_low": 1.2}, "algorithm.rollout_mask_low: Value error, must be between 0 and 1"),
        ({"rollout_mask_high": 1.0}, "algorithm.rollout_mask_high: Value error, must be above 1"),
        ({"rollout_mask": "icepop"}, "algorithm.rollout_mask: Input should be 'off', 'token', 'sequence' or 'geo"),
    ],
)
def test_option_errors_name_the_key(options, message):
    with pytest.raises(ConfigError, match=message):
        load_config(data=config("/m", "/tmp/unused", options, {"engine": "hf"}))


# -- end to end ------------------------------------------------------------------------------


class SampledLogprobsEngine(HFEngine):
    """The hf engine, recording each token's logprob under the distribution it sampled from (after
    temperature, top-k and top-p, renormalised), as vLLM reports them; its decoding loop runs on the
    CPU with ``cache: static``."""

    def _sample(self, logits, sampling, warpers):
        scores = warpers(None, logits.float())  # -inf outside the nucleus
        token = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        return token, torch.log_softmax(scores, dim=-1).gather(-1, token[:, None]).squeeze(1)


class Plugins(SevensPlugin):
    @hookimpl
    def register_rollout_engines(self, register):
        register("hf_sampled", SampledLogprobsEngine)


# sync_check off: its probe compares the engine's logprobs with the policy's, and the nucleus's are
# -log(top_p) ~ 0.22 above them by design, close to the check's tolerance (0.3)
SAMPLED = {"engine": "hf_sampled", "cache": "static", "sync_check": 0}


def train(tiny_model, tmp_path, algorithm, rollout, **trainer):
    run_dir = tmp_path / "run"
    cfg = load_config(data=config(tiny_model, run_dir, algorithm, rollout, **trainer))
    Trainer(build_run(cfg)).train()
    return metrics_rows(run_dir)


def rises(rows):
    rewards = [r["reward/mean"] for r in rows]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, f"reward did not rise: {rewards}"


def column(rows, key):
    return [r[key] for r in rows]


def test_hf_engine_records_the_trainers_distribution_weights_are_one(tiny_model, tmp_path, register_plugin):
    register_plugin(SevensPlugin(), name="sevens")
    rows = train(tiny_model, tmp_path, {"rollout_correction": "token"}, {"engine": "hf", "top_p": 0.8})
    for key in ("weight_mean", "weight_max", "weight_min"):
        assert column(rows, f"rollout_corr/{key}") == pytest.approx([1.0] * len(rows), abs=1e-5)
    assert max(column(rows, "rollout_corr/kl_k1"), key=abs) == pytest.approx(0.0, abs=1e-5)
    assert set(column(rows, "rollout_corr/truncated_fraction")) == {0.0}
    rises(rows)


def test_top_p_engine_weights_are_the_nucleus_mass(tiny_model, tmp_path, register_plugin):
    """Sampled from the top-p nucleus and scored there, each token's ratio pi_old / pi_rollout is the
    probability mass of its nucleus: in [top_p, 1), below 1 every time, so TIS never truncates."""
    register_plugin(Plugins(), name="plugins")
    rows = train(tiny_model, tmp_path, {"rollout_correction": "token"}, {**SAMPLED, "top_p": 0.8})
    assert max(column(rows, "rollout_corr/weight_max")) < 1.0
    assert min(column(rows, "rollout_corr/weight_min")) >= 0.8 - 1e-5
    assert set(column(rows, "rollout_corr/truncated_fraction")) == {0.0}
    # every token's log ratio is negative: KL k1 = mean(-d) = the trainer's mean |d|
    assert column(rows, "rollout_corr/kl_k1") == pytest.approx(column(rows, "rollout/logprob_diff_mean"), rel=1e-4)
    assert min(column(rows, "rollout_corr/kl_k3")) > 0
    rises(rows)


def test_bfloat16_engine_truncates_and_masks_both_ways(tiny_model, tmp_path, register_plugin):
    """A bfloat16 copy scatters the ratios around 1 both ways: a small cap truncates the ones above it
    and a tight band masks some tokens, the loss still trains."""
    register_plugin(Plugins(), name="plugins")
    algorithm = {
        "rollout_correction": "token",
        "rollout_correction_cap": 1.001,
        "rollout_mask": "token",
        "rollout_mask_low": 0.995,
        "rollout_mask_high": 1.005,
    }
    rows = train(tiny_model, tmp_path, algorithm, {**SAMPLED, "dtype": "bfloat16"})
    truncated, masked = column(rows, "rollout_corr/truncated_fraction"), column(rows, "rollout_corr/masked_fraction")
    assert max(truncated) > 0 and max(masked) > 0 and max(masked) < 0.9, (truncated, masked)
    assert max(column(rows, "rollout_corr/weight_max")) == pytest.approx(1.001)  # capped ones
    assert min(column(rows, "rollout_corr/weight_min")) == 0.0  # masked ones
    rises(rows)


def test_correction_with_several_updates_per_step(tiny_model, tmp_path, register_plugin):
    """With trainer.epochs 2 the old logprobs come from the trainer's pass before the update; the
    geometric weight of a response is the geometric mean of its nucleus masses, in [top_p, 1)."""
    register_plugin(Plugins(), name="plugins")
    rows = train(tiny_model, tmp_path, {"rollout_correction": "geometric"}, {**SAMPLED, "top_p": 0.9}, epochs=2)
    assert max(column(rows, "rollout_corr/weight_max")) < 1.0
    assert min(column(rows, "rollout_corr/weight_min")) >= 0.9 - 1e-5
    rises(rows)
