"""PPO with off-policy correction: the loss and its gradient against hand-computed values (a batch
with a hole and padding, a clipped token as after an earlier epoch), and the options' errors.
End to end, the correction is exercised by plugins/algo_grpo/tests/test_rollout_correction_grpo.py:
the same ``hybridrl.correction`` code on the same trainer."""

import math

import pytest
import torch
from hybridrl_algo_ppo import PPO

from hybridrl.batch import Batch
from hybridrl.config import ConfigError, load_config

MASK = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]])  # a hole at t = 2 of row 0; padding in row 1
# pi_old / pi_rollout per valid token: row 0: 3, 0.5, 1.5 (product 2.25); row 1: 0.25, 1.2 (product 0.3)
RATIOS = [[3.0, 0.5, 1.0, 1.5], [0.25, 1.2, 1.0, 1.0]]


def batch():
    b = Batch()
    b["response_mask"] = MASK
    b["old_logprobs"] = torch.full((2, 4), -1.0)
    b["rollout_logprobs"] = -1.0 - torch.tensor(RATIOS).log()
    b["rollout_logprobs"][0, 2] = float("-inf")  # the engine never scored the observation token
    b["advantages"] = torch.tensor([[1.0, 1.0, 0.0, 1.0], [-2.0, -2.0, 0.0, 0.0]])
    return b


def test_geometric_weights_and_sequence_mask_scale_the_clipped_loss_not_the_kl():
    algo = PPO(
        PPO.Options(
            critic=False,
            use_kl_loss=True,
            kl_loss_coef=0.5,
            kl_loss_type="k2",
            rollout_correction="geometric",
            rollout_mask="sequence",
        ),
        None,
    )
    b = batch()
    # as in a later epoch, the policy has moved: ratio to old 1.5 (clipped at 1.2, A > 0), 1, -, 0.5
    logp = (b["old_logprobs"] + torch.tensor([[math.log(1.5), 0.0, 0.0, math.log(0.5)], [0.0] * 4])).requires_grad_()
    b["ref_logprobs"] = logp.detach() - 1.0  # k2 = 0.5 on every token
    loss, m = algo.loss(b, logp, torch.zeros(2, 4))
    g0 = 2.25 ** (1 / 3)  # row 0: geometric mean of 3, 0.5, 1.5, kept by the band [0.5, 5]
    # row 0's tokens: -1.2 (clipped), -1, -0.5 (ratio 0.5 < 0.8: the unclipped -A r is larger); row 1 masked
    # (its product 0.3 < 0.5), its tokens still counted by token-mean's normaliser: 5 tokens
    pg = g0 * (-1.2 - 1.0 - 0.5) / 5
    assert m["actor/pg_loss"] == pytest.approx(pg, rel=1e-6)
    assert loss.item() == pytest.approx(pg + 0.5 * 0.5, rel=1e-6)
    assert m["actor/kl_loss"] == pytest.approx(0.5)
    assert float(m["rollout_corr/weight_mean"]) == pytest.approx(3 * g0 / 5, rel=1e-6)
    assert float(m["rollout_corr/masked_fraction"]) == pytest.approx(2 / 5)
    assert float(m["rollout_corr/truncated_fraction"]) == 0.0
    loss.backward()
    # pg: 0 for the clipped token, -A w r / 5 for the others; k2: 0.5 x (logp - ref) / 5 on valid tokens
    pg_grad = torch.tensor([[0.0, -g0 * 1.0, 0.0, -g0 * 0.5], [0.0] * 4]) / 5
    torch.testing.assert_close(logp.grad, pg_grad + 0.5 * MASK / 5, rtol=1e-6, atol=1e-7)


def test_token_truncation_in_ppo():
    algo = PPO(PPO.Options(critic=False, rollout_correction="token", rollout_correction_cap=1.25), None)
    loss, m = algo.loss(batch(), torch.full((2, 4), -1.0), torch.zeros(2, 4))
    w = [1.25, 0.5, 1.25, 0.25, 1.2]  # min(ratio, 1.25) on the valid tokens
    adv = [1.0, 1.0, 1.0, -2.0, -2.0]
    assert loss.item() == pytest.approx(-sum(a * x for a, x in zip(adv, w)) / 5, rel=1e-6)
    assert float(m["rollout_corr/truncated_fraction"]) == pytest.approx(2 / 5)
    assert float(m["rollout_corr/weight_max"]) == pytest.approx(1.25)


def test_correction_off_leaves_the_loss_as_it_was():
    loss, m = PPO(PPO.Options(critic=False), None).loss(batch(), torch.full((2, 4), -1.0), torch.zeros(2, 4))
    assert loss.item() == pytest.approx(-(1 + 1 + 1 - 2 - 2) / 5)
    assert not [k for k in m if k.startswith("rollout_corr/")]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"rollout_correction_cap": 1.0}, "algorithm.rollout_correction_cap: Value error, must be above 1"),
        ({"rollout_mask_low": -0.1}, "algorithm.rollout_mask_low: Value error, must be between 0 and 1"),
        ({"rollout_mask_high": 0.5}, "algorithm.rollout_mask_high: Value error, must be above 1"),
    ],
)
def test_option_errors_name_the_key(options, message):
    data = {
        "model": {"path": "/m"},
        "data": {"source": "reasoning_gym", "task": "chain_sum"},
        "rewards": [{"function": "answer_match"}],
        "algorithm": {"name": "ppo", "critic": False, **options},
    }
    with pytest.raises(ConfigError, match=message):
        load_config(data=data)
