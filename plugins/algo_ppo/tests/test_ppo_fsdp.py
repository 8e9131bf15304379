"""PPO under torchrun with sharding ``fsdp``: one step on two ranks equals one step on one process.

The critic is wrapped by the strategy, GAE whitens over both ranks' tokens, the adaptive KL
controller sees the KL of the whole step and the value loss is scaled to the global
mini-batch: if any of these were per rank, the policy, the critic or beta would differ.
This file is also the worker script (``torchrun ... test_ppo_fsdp.py worker MODEL OUT``);
the launch follows the core's tests/test_fsdp.py (gloo on 127.0.0.1, one thread per rank).
"""

from __future__ import annotations

import dataclasses
import io
import sys
from pathlib import Path

import pytest
import torch
from hybridrl_testing import fixed_batch, torchrun

from hybridrl import distributed
from hybridrl.batch import even_out
from hybridrl.distributed import exit_rank

pytestmark = pytest.mark.torchrun  # make test runs these one at a time, after the others

LR = 0.5  # SGD: the update is linear in the gradient, so any scale error shows
LENGTHS = [[2, 3, 4, 2], [3, 2, 4, 3], [10, 12, 11, 9], [12, 10, 9, 11]]  # rank 0: groups 0-1, rank 1: 2-3
ALGORITHM = {
    "name": "ppo",
    "gamma": 0.95,
    "lam": 0.9,
    "use_kl_in_reward": True,
    "kl_ctrl": "adaptive",
    "kl_coef": 0.05,
    "kl_horizon": 10,
    "critic_epochs": 2,  # the second epoch trains a critic whose head is no longer zero
    "critic_micro_batch_size": 2,
    "critic_max_grad_norm": 1e6,
}


def config(model: str, run_dir: Path, strategy: str) -> dict:
    return {
        "model": {"path": model},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 32},
        "rollout": {"engine": "hf", "n": 4, "max_tokens": 8},
        "rewards": [{"function": "format", "pattern": "7"}],
        "algorithm": ALGORITHM,
        # activation checkpointing reaches the critic's backbone through the value model
        "sharding": {"strategy": strategy, **({"activation_checkpointing": True} if strategy == "fsdp" else {})},
        "trainer": {
            "steps": 1,
            "prompts_per_step": 4,
            "micro_batch_size": 2,
            "max_grad_norm": 1e6,
            "seed": 0,
            "threads": 1,
            "run_dir": str(run_dir),
        },
        "logging": {"loggers": ["jsonl"]},
    }


def one_step(model: str, run_dir: Path, strategy: str) -> dict:
    """Full policy and critic weights, beta and metrics after one step; and a state round trip."""
    from hybridrl.config import load_config
    from hybridrl.run import build_run
    from hybridrl.trainer import Trainer

    run = build_run(load_config(data=config(model, run_dir, strategy)))
    optimizer = torch.optim.SGD([p for p in run.policy.parameters() if p.requires_grad], lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    run = dataclasses.replace(run, optimizer=optimizer, scheduler=scheduler)  # the run's parts are read-only
    trainer = Trainer(run)
    algo = run.algorithm
    algo.critic_optimizer = torch.optim.SGD(algo.critic.parameters(), lr=LR)
    batch = fixed_batch(run.tokenizer, LENGTHS)
    batch = even_out(batch, batch).to(run.ctx.device)
    trainer.compute_logprobs(batch)
    metrics = algo.compute_advantages(batch)
    metrics |= trainer.update(batch, step=1)  # the policy, then the critic
    result = {
        "policy": {k: t.clone() for k, t in run.strategy.full_tensors(run.policy)},
        "critic": {k: t.clone() for k, t in run.strategy.full_tensors(algo.critic)},
        "kl_coef": algo.kl_coef,
        "metrics": metrics,
    }
    # the algorithm's state (sharded critic and optimizer under fsdp) survives a weights-only save
    buffer = io.BytesIO()
    torch.save(algo.state_dict(), buffer)
    buffer.seek(0)
    restored = type(algo)(algo.options, run.ctx)
    restored.critic_optimizer = torch.optim.SGD(restored.critic.parameters(), lr=LR)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    result["restored_critic"] = {k: t.clone() for k, t in run.strategy.full_tensors(restored.critic)}
    result["restored_kl_coef"] = restored.kl_coef
    run.engine.close()
    return result


def worker(model: str, out: str) -> None:
    result = one_step(model, Path(out).parent / "run", "fsdp")
    if distributed.is_main():
        torch.save(result, out)
    distributed.teardown(together=True)


def test_one_ppo_step_on_two_fsdp_ranks_equals_single(tiny_model, tmp_path):
    want = one_step(tiny_model, tmp_path / "single", "single")
    out = tmp_path / "fsdp" / "result.pt"
    out.parent.mkdir()
    proc = torchrun([__file__, "worker", tiny_model, str(out)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out, weights_only=True)

    assert got["kl_coef"] == want["kl_coef"] != ALGORITHM["kl_coef"]  # the controller saw the global KL
    for part in ("policy", "critic"):
        assert got[part].keys() == want[part].keys()
        for key in want[part]:
            torch.testing.assert_close(got[part][key], want[part][key], rtol=1e-4, atol=1e-5, msg=f"{part}: {key}")
    head = want["critic"]["head.weight"]
    assert head.abs().max() > 1e-3  # the critic moved by more than the tolerance
    for key in ("critic/grad_norm", "critic/explained_var", "actor/grad_norm"):
        torch.testing.assert_close(
            torch.tensor(got["metrics"][key]), torch.tensor(want["metrics"][key]), rtol=1e-4, atol=1e-6, msg=key
        )
    for result in (want, got):
        assert result["restored_kl_coef"] == result["kl_coef"]
        for key, value in result["critic"].items():
            assert torch.equal(result["restored_critic"][key], value), key


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker(*sys.argv[2:4])
    exit_rank(0)  # the rank's work is done: without the teardown that was seen to abort it
