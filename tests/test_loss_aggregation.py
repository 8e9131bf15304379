"""Loss aggregation: each loss_agg_mode's normaliser, by hand; and Dr. GRPO's constant normaliser in
the trainer: the loss over the global mini-batch, whatever the padded width and the micro-batches."""

import pytest
import torch
from hybridrl_testing import SevensPlugin, fixed_batch

from hybridrl import functional as F
from hybridrl.batch import pad_responses
from hybridrl.config import load_config
from hybridrl.passes import response_logprobs
from hybridrl.run import build_run
from hybridrl.trainer import Trainer

LOSS = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 5.0, 0.0, 0.0], [6.0, 0.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]])  # 3 responses of 3, 2 and 1 tokens


@pytest.mark.parametrize(
    "mode, norm_length, want, normaliser",
    [
        ("token-mean", None, (1 + 2 + 3 + 4 + 5 + 6) / 6, 6),
        ("seq-mean-token-sum", None, (6 + 9 + 6) / 3, 3),
        ("seq-mean-token-mean", None, (6 / 3 + 9 / 2 + 6 / 1) / 3, 3),
        ("seq-mean-token-sum-norm", 10, (6 + 9 + 6) / (3 * 10), 30),  # Dr. GRPO: N responses x L
        ("seq-mean-token-sum-norm", None, (6 + 9 + 6) / (3 * 4), 12),  # L defaults to the padded width
    ],
)
def test_each_mode_by_hand(mode, norm_length, want, normaliser):
    agg = F.LossAggregation(mode, norm_length)
    assert agg(LOSS, MASK).item() == pytest.approx(want)
    assert F.agg_loss(LOSS, MASK, agg).item() == pytest.approx(want)
    assert agg.normaliser(MASK) == normaliser
    # a padding row (empty mask) adds nothing, and the real rows are what the global normaliser counts
    padded = torch.cat([MASK, torch.zeros(1, 4, dtype=MASK.dtype)])
    assert agg.normaliser(padded, rows=3) == normaliser


def test_unknown_mode_lists_the_modes():
    with pytest.raises(ValueError, match="Unknown loss aggregation mode 'mean'. Available: token-mean"):
        F.LossAggregation("mean")


def config(model, run_dir, **algorithm):
    return {
        "model": {"path": model},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 16},
        "rollout": {"n": 4, "max_tokens": 16},
        "rewards": [{"function": "sevens"}],
        "algorithm": {"name": "grpo", "loss_agg_mode": "seq-mean-token-sum-norm", **algorithm},
        "trainer": {"prompts_per_step": 4, "run_dir": str(run_dir), "max_grad_norm": 1e6},
        "logging": {"loggers": []},
    }


LENGTHS = [[2, 3, 4, 2], [14, 12, 10, 13], [5, 9, 1, 7], [11, 3, 8, 6]]  # 16 responses, the longest 14


def update_gradients(trainer, batch) -> dict[str, torch.Tensor]:
    grads = {}
    trainer.run.optimizer.step = lambda: grads.update(
        {n: p.grad.clone() for n, p in trainer.run.policy.named_parameters()}
    )
    trainer.update(batch, 1)
    return grads


def test_dr_grpo_normaliser_is_responses_times_max_tokens(tiny_model, tmp_path, register_plugin):
    """loss = sum_i sum_t m l / (N x L) with N the mini-batch's responses and L = rollout.max_tokens (16),
    not the step's padded width (14): the gradients are those of that formula, the same when the
    batch is padded to 30 columns and when it is cut into micro-batches."""
    register_plugin(SevensPlugin(), name="sevens")
    t = Trainer(build_run(load_config(data=config(tiny_model, tmp_path / "a"))))
    batch = fixed_batch(t.run.tokenizer, LENGTHS)
    assert batch["responses"].shape[1] == 14
    t.run.algorithm.compute_advantages(batch)

    # by hand: on-policy the ratio is 1 and the gradient is -sum m A grad(logp) / (N L)
    t.run.policy.zero_grad()
    lp, _ = response_logprobs(t.run.policy, batch.input_ids, batch.attention_mask, 14)
    mask = batch["response_mask"].float()
    (-(batch["advantages"] * torch.exp(lp - lp.detach()) * mask).sum() / (16 * 16)).backward()
    want = {n: p.grad.clone() for n, p in t.run.policy.named_parameters()}

    got = update_gradients(t, batch)
    wide = update_gradients(t, pad_responses(batch, 30, t.run.tokenizer.pad_token_id))
    t2 = Trainer(
        build_run(load_config(data=config(tiny_model, tmp_path / "b"), overrides=["trainer.micro_batch_size=4"]))
    )
    micro = update_gradients(t2, batch)
    for name, g in want.items():
        assert g.abs().max() > 0, name
        for grads in (got, wide, micro):
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-8, msg=name)


def test_an_explicit_normaliser_length_is_used(tiny_model, tmp_path, register_plugin):
    register_plugin(SevensPlugin(), name="sevens")
    t = Trainer(build_run(load_config(data=config(tiny_model, tmp_path / "a", loss_norm_length=32))))
    assert t.run.algorithm.loss_aggregation == F.LossAggregation("seq-mean-token-sum-norm", 32)
    t = Trainer(build_run(load_config(data=config(tiny_model, tmp_path / "b"))))
    assert t.run.algorithm.loss_aggregation.norm_length == 16  # rollout.max_tokens
