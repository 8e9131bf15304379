"""The shared RL math against hand-computed values."""

import math

import pytest
import torch

from hybridrl import functional as F

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
LOSS = torch.tensor([[1.0, 3.0, 100.0], [5.0, 100.0, 100.0]])


def test_masked_mean_ignores_masked_values():
    assert F.masked_mean(LOSS, MASK).item() == pytest.approx(3.0)  # (1 + 3 + 5) / 3


def test_masked_whiten_uses_unbiased_variance():
    x = torch.tensor([[1.0, 2.0, 99.0, 3.0]])
    m = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    # mean 2, unbiased var ((1 + 0 + 1) / 2) = 1
    out = F.masked_whiten(x, m)
    assert out[0, [0, 1, 3]].tolist() == pytest.approx([-1 / math.sqrt(1 + 1e-8), 0.0, 1 / math.sqrt(1 + 1e-8)])


def test_masked_var_needs_two_values():
    with pytest.raises(ValueError, match="two unmasked"):
        F.masked_var(torch.ones(1, 2), torch.tensor([[1.0, 0.0]]))


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 3 + 5) / 3),
        ("seq-mean-token-sum", ((1 + 3) + 5) / 2),
        ("seq-mean-token-mean", ((1 + 3) / 2 + 5 / 1) / 2),
        ("seq-mean-token-sum-norm", ((1 + 3) + 5) / (2 * 3)),  # divided by N x L, L = T = 3 when not set
    ],
)
def test_agg_loss_modes(mode, expected):
    assert F.agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_agg_loss_unknown_mode_lists_choices():
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-sum"):
        F.agg_loss(LOSS, MASK, "mean")


def test_kl_penalty_kinds():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    assert F.kl_penalty(logp, ref, "k1").item() == pytest.approx(0.5)
    assert F.kl_penalty(logp, ref, "abs").item() == pytest.approx(0.5)
    assert F.kl_penalty(logp, ref, "k2").item() == pytest.approx(0.125)
    x = -0.5  # ref - logp
    assert F.kl_penalty(logp, ref, "k3").item() == pytest.approx(math.exp(x) - x - 1)


def test_k3_is_clamped():
    out = F.kl_penalty(torch.tensor([-100.0]), torch.tensor([0.0]), "k3")  # x = 100 -> clamp 20
    assert out.item() == pytest.approx(10.0)


def test_policy_loss_clipping_and_dual_clip():
    old = torch.zeros(1, 4)
    # ratios e^0.5 (clipped above for A>0), e^-0.5 (clipped below for A<0), 1, and e^2 with A<0
    logp = torch.tensor([[0.5, -0.5, 0.0, 2.0]])
    adv = torch.tensor([[1.0, -1.0, 2.0, -1.0]])
    mask = torch.ones(1, 4)
    loss, m = F.policy_loss(old, logp, adv, mask, clip_low=0.2, clip_high=0.2, clip_c=3.0)
    r = [math.exp(0.5), math.exp(-0.5), 1.0, math.exp(2.0)]
    per_token = [
        max(-1 * r[0], -1 * 1.2),  # A>0: max(-A r, -A clip(r)) = -1.2
        max(1 * r[1], 1 * 0.8),  # A<0: max(0.607, 0.8) = 0.8, below clip_c * 1 = 3
        -2.0,
        min(max(r[3], 1.2), 3.0),  # A<0, huge ratio: dual clip caps at 3
    ]
    assert loss.item() == pytest.approx(sum(per_token) / 4)
    assert m["clipfrac"].item() == pytest.approx(2 / 4)  # tokens 0 and 1 are clipped
    assert m["clipfrac_lower"].item() == pytest.approx(1 / 4)  # token 3 hits the dual clip
    assert m["ppo_kl"].item() == pytest.approx(-(0.5 - 0.5 + 0 + 2) / 4)


def test_policy_loss_gradient_is_zero_when_clipped():
    old = torch.zeros(1, 1)
    logp = torch.tensor([[0.5]], requires_grad=True)
    loss, _ = F.policy_loss(old, logp, torch.ones(1, 1), torch.ones(1, 1))
    loss.backward()
    assert logp.grad.item() == 0.0


def test_logprobs_and_entropy_from_logits():
    logits = torch.tensor([[0.0, math.log(3.0)]])  # probs 1/4, 3/4
    assert F.logprobs_from_logits(logits, torch.tensor([1])).item() == pytest.approx(math.log(0.75))
    assert F.entropy_from_logits(logits).item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))


@pytest.mark.parametrize("mode", F.AGG_MODES)
def test_micro_batch_weights_make_accumulation_exact(mode):
    torch.manual_seed(0)
    loss = torch.rand(4, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]).float()
    agg = F.LossAggregation(mode, 8)
    full = agg(loss, mask)
    # each part weighted by its normaliser over the whole one, as hybridrl.update.run_update does
    acc = sum(
        agg(loss[i : i + 2], mask[i : i + 2]) * agg.normaliser(mask[i : i + 2]) / agg.normaliser(mask) for i in (0, 2)
    )
    assert acc.item() == pytest.approx(full.item())


def on_policy_expected_gradient(kind: str, logits: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """E_{y ~ pi}[grad k(y)] exactly, over a categorical pi = softmax(logits): the sampling
    distribution is a weight (no gradient through it), as when the loss is differentiated."""
    logits = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(logits, -1)
    per_token = F.kl_penalty(logp, ref_logp, kind)  # the estimate for each possible token y
    (logp.exp().detach() * per_token).sum().backward()
    return logits.grad


def test_kl_loss_gradients_on_policy_k1_is_zero_k2_and_k3_pull():
    """Why k1 and abs are refused as KL loss terms (arXiv:2506.09477): on-policy, k1's expected
    gradient is 0; k2's is the gradient of KL(pi || ref), k3's that of KL(ref || pi)."""
    logits = torch.tensor([1.0, -0.5, 0.3, 2.0])
    ref_logp = torch.log_softmax(torch.tensor([0.0, 1.0, -1.0, 0.5]), -1)

    assert on_policy_expected_gradient("k1", logits, ref_logp).abs().max() < 1e-6

    def true_gradient(divergence):
        x = logits.clone().requires_grad_(True)
        divergence(torch.log_softmax(x, -1)).backward()
        return x.grad

    reverse = true_gradient(lambda logp: (logp.exp() * (logp - ref_logp)).sum())  # KL(pi || ref)
    forward = true_gradient(lambda logp: (ref_logp.exp() * (ref_logp - logp)).sum())  # KL(ref || pi)
    torch.testing.assert_close(on_policy_expected_gradient("k2", logits, ref_logp), reverse)
    torch.testing.assert_close(on_policy_expected_gradient("k3", logits, ref_logp), forward)
    assert reverse.abs().max() > 0.1 and forward.abs().max() > 0.1
