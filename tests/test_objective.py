"""The policy objective that grpo and ppo share (hybridrl.objective), against hand-computed values."""

import math

import pytest
import torch

from hybridrl import functional as F
from hybridrl import plugins
from hybridrl.batch import Batch
from hybridrl.objective import PolicyObjective

LN2 = math.log(2.0)


def two_by_three() -> tuple[Batch, torch.Tensor, torch.Tensor]:
    """Two responses of 3 and 2 tokens, A = +1 and A = -1, on float64 so that the sums are exact.

    Ratios r = pi / pi_old: row 0 [1.5, 1, 0.5], row 1 [4, 1, (masked)]. With clip 0.2 and clip_c 3
    the token losses L are
      row 0 (A = +1): max(-1.5, -1.2) = -1.2 (clipped), -1, max(-0.5, -0.8) = -0.5;
      row 1 (A = -1): min(max(4, 1.2), 3) = 3 (dual clip), 1.
    The reference differs on one token, row 0 token 1, by log pi_ref - log pi = ln 2: k3 = 2 - ln 2 - 1.
    """
    b = Batch()
    b["response_mask"] = torch.tensor([[1, 1, 1], [1, 1, 0]])
    b["old_logprobs"] = torch.zeros(2, 3, dtype=torch.float64)
    b["advantages"] = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]], dtype=torch.float64)
    logprobs = torch.log(torch.tensor([[1.5, 1.0, 0.5], [4.0, 1.0, 1.0]], dtype=torch.float64))
    b["ref_logprobs"] = logprobs + torch.tensor([[0.0, LN2, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    entropy = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]], dtype=torch.float64)  # 99: masked
    return b, logprobs, entropy


# mode: (agg L, agg H, agg KL); token sums: L 1.3, H 15, KL 1 - ln 2; 5 tokens, 2 responses
BY_HAND = {
    "token-mean": (1.3 / 5, 15 / 5, (1 - LN2) / 5),
    "seq-mean-token-sum": (1.3 / 2, 15 / 2, (1 - LN2) / 2),
}


@pytest.mark.parametrize("mode", sorted(BY_HAND))
def test_every_term_by_hand(mode):
    pg, ent, kl = BY_HAND[mode]
    objective = PolicyObjective(F.LossAggregation(mode), clip_c=3.0, entropy_coeff=0.1, kl_coef=0.5)
    b, logprobs, entropy = two_by_three()
    loss, m = objective(b, logprobs, entropy)
    assert m["actor/pg_loss"] == pytest.approx(pg)
    assert m["actor/entropy_loss"] == pytest.approx(ent)
    assert m["actor/kl"] == pytest.approx(kl)
    assert loss.item() == pytest.approx(pg - 0.1 * ent + 0.5 * kl)
    assert m["actor/clipfrac"] == pytest.approx(1 / 5)  # row 0 token 0 (L2 > L1)
    assert m["actor/clipfrac_lower"] == pytest.approx(1 / 5)  # row 1 token 0 (the dual clip bound)
    assert m["actor/ppo_kl"] == pytest.approx(-math.log(1.5 * 0.5 * 4.0) / 5)  # mean of old - new
    assert objective.needs_reference and objective.needs_entropy_grad


def test_terms_with_a_zero_coefficient_are_not_computed():
    objective = PolicyObjective(F.LossAggregation("token-mean"))  # no entropy bonus, no KL term
    b, logprobs, entropy = two_by_three()
    del b.tensors["ref_logprobs"]  # not needed
    loss, m = objective(b, logprobs, entropy)
    assert loss.item() == pytest.approx(1.3 / 5)
    assert set(m) == {"actor/pg_loss", "actor/clipfrac", "actor/clipfrac_lower", "actor/ppo_kl"}
    assert not objective.needs_reference and not objective.needs_entropy_grad


def test_a_kl_estimator_that_does_not_regularise_is_refused():
    with pytest.raises(ValueError, match="KL estimator 'k1' as a loss term"):
        PolicyObjective(F.LossAggregation(), kl_coef=0.1, kl_kind="k1")


def test_grpo_and_ppo_share_it_and_keep_their_kl_metric_names():
    grpo, ppo = plugins.lookup("algorithm", "grpo"), plugins.lookup("algorithm", "ppo")
    common = {"clip_low": 0.2, "clip_high": 0.28, "clip_c": 3.0, "entropy_coeff": 0.1, "loss_agg_mode": "token-mean"}
    g = grpo(grpo.Options(**common, kl_coef=0.5, kl_kind="k2"), ctx=None)
    p = ppo(ppo.Options(**common, critic=False, use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k2"), ctx=None)
    b, logprobs, entropy = two_by_three()
    (gl, gm), (pl, pm) = g.loss(b, logprobs, entropy), p.loss(b, logprobs, entropy)
    assert gl.item() == pl.item()
    assert gm.pop("actor/kl") == pm.pop("actor/kl_loss")
    assert gm == pm
