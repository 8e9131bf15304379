"""Sharding strategy ``fsdp`` and SPMD training under torchrun, on the CPU with gloo.

The two-process tests start real torchrun launches on 127.0.0.1: this file is also the
worker script (``python -m torch.distributed.run ... tests/test_fsdp.py worker ...``).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hybridrl_testing import assert_same_metrics, fixed_batch, metrics_rows, small_model, torchrun
from safetensors.torch import load_file

from hybridrl import devices, distributed
from hybridrl.batch import Batch, even_out
from hybridrl.distributed import exit_rank

pytestmark = pytest.mark.torchrun  # make test runs these one at a time, after the others

LR = 0.5  # SGD in the equality test: the update is linear in the gradient, so any scale error shows

# One optimizer step on a fixed batch, three ways to aggregate and shard. Rank 0 takes groups 0-1
# (responses of 2-4 tokens), rank 1 groups 2-3 (10-14 tokens): a mean of per-rank token means
# is far from the global token mean, so only a correct cross-rank normalisation matches `single`.
CASES = {
    "token_mean": {
        "algorithm": {"name": "grpo", "kl_coef": 0.05},
        "sharding": {"activation_checkpointing": True},
        "trainer": {"micro_batch_size": 2, "max_grad_norm": 1e6},
    },
    "seq_mean_uneven_rows": {  # a group dropped on rank 1 (as DAPO's filter would): padding rows
        "algorithm": {"name": "grpo", "loss_agg_mode": "seq-mean-token-mean"},
        "sharding": {"mode": "shard_grad_op"},
        "trainer": {"max_grad_norm": 1e6},
        "drop_group": 3,
    },
    "sum_norm_padding_micro_batch": {  # rank 1's second micro-batch holds only padding rows
        "algorithm": {"name": "grpo", "loss_agg_mode": "seq-mean-token-sum-norm"},
        "trainer": {"micro_batch_size": 4, "max_grad_norm": 1e6},
        "drop_group": 3,
    },
    "sum_norm_clipped_hybrid": {  # clipping active: the norm must be the global one
        "algorithm": {"name": "grpo", "loss_agg_mode": "seq-mean-token-sum-norm"},
        "sharding": {"mode": "hybrid_shard", "shard_group_size": 1},
        "trainer": {"max_grad_norm": 0.05},
    },
    "token_budget": {  # a token budget under torchrun: each rank cut by its lengths, as many passes as the most
        "algorithm": {"name": "grpo", "loss_agg_mode": "seq-mean-token-mean"},
        "trainer": {"micro_batch_tokens": 80, "max_grad_norm": 1e6},
    },
    "lora_kl": {  # LoRA adapters sharded with the base; the reference is the base with them off
        "model": {"lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}},
        "algorithm": {"name": "grpo", "kl_coef": 0.05},
        "trainer": {"micro_batch_size": 4, "max_grad_norm": 1e6},
    },
}
LENGTHS = [[2, 3, 4, 2], [3, 2, 4, 3], [10, 14, 12, 11], [13, 10, 14, 12]]  # per group, n = 4


def config(model_path, run_dir, strategy="single", **sections):
    data = {
        "model": {"path": str(model_path)},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 32},
        "rollout": {"engine": "hf", "n": 4, "max_tokens": 8},
        "rewards": [{"function": "format", "pattern": "7"}],
        "algorithm": {"name": "grpo"},
        "sharding": {"strategy": strategy},
        "trainer": {"steps": 1, "prompts_per_step": 4, "seed": 0, "threads": 1, "run_dir": str(run_dir)},
        "logging": {"loggers": ["jsonl"]},
    }
    for key, value in sections.items():
        data[key] = {**data[key], **value} if key in ("model", "sharding", "trainer", "algorithm") else value
    if strategy == "single":
        data["sharding"] = {"strategy": "single"}
    return data


def one_step(model, run_dir, strategy: str, case: dict) -> tuple[dict, dict]:
    """Full parameters after one update of the trainer on the fixed batch, and its metrics."""
    import dataclasses

    from hybridrl.config import load_config
    from hybridrl.run import build_run
    from hybridrl.trainer import Trainer

    sections = {k: v for k, v in case.items() if k != "drop_group"}
    run = build_run(load_config(data=config(model, run_dir, strategy, **sections)))
    params = [p for p in run.policy.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    trainer = Trainer(dataclasses.replace(run, optimizer=optimizer, scheduler=scheduler))  # the run, with SGD
    batch = fixed_batch(run.tokenizer, LENGTHS, case.get("drop_group"))
    batch = even_out(batch, batch).to(run.ctx.device)
    trainer.compute_logprobs(batch)
    run.algorithm.compute_advantages(batch)
    metrics = trainer.update(batch, step=1)
    full = {name: t.clone() for name, t in trainer.policy_tensors()}  # LoRA: merged, base names
    run.engine.close()
    return full, metrics


def worker(model: str, out: str) -> None:
    """Under torchrun: every case with ``fsdp`` on this rank; rank 0 writes the results."""
    results = {name: one_step(model, Path(out).parent / name, "fsdp", case) for name, case in CASES.items()}
    if distributed.is_main():
        torch.save(results, out)
    distributed.teardown(together=True)  # rank 1 leaving while rank 0 still wrote once aborted rank 1


# -- launching -----------------------------------------------------------------------------


def test_one_fsdp_step_on_two_ranks_equals_single(tiny_model, tmp_path):
    single = {name: one_step(tiny_model, tmp_path / "single" / name, "single", c) for name, c in CASES.items()}
    out = tmp_path / "fsdp" / "results.pt"
    out.parent.mkdir()
    proc = torchrun([__file__, "worker", tiny_model, str(out)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    fsdp = torch.load(out, weights_only=True)

    initial = load_file(Path(tiny_model) / "model.safetensors")
    for name in CASES:
        (want, want_metrics), (got, got_metrics) = single[name], fsdp[name]
        assert got.keys() == want.keys(), name  # the HF state dict's names, tied weights included
        moved = max((want[k] - initial[k]).abs().max().item() for k in initial)
        assert moved > 1e-3, (name, moved)  # the step did something a tolerance of 1e-5 can see
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-5, msg=f"{name}: {key}")
        assert got_metrics["actor/grad_norm"] == pytest.approx(want_metrics["actor/grad_norm"], rel=1e-4), name
        # token statistics over both ranks, padding rows and padding-only micro-batches weighing nothing
        for key in ("actor/entropy", "actor/ppo_kl", "rollout/logprob_diff_mean", "rollout/logprob_diff_max"):
            assert got_metrics[key] == pytest.approx(want_metrics[key], rel=1e-4, abs=1e-6), (name, key)


def metrics_worker(out: str) -> None:
    """Under torchrun: reduce known per-rank values the way the step does; rank 0 writes the result."""
    from hybridrl.metrics import WeightedStats, reduce_metrics

    distributed.setup(torch.device("cpu"))
    r = distributed.rank()
    step = reduce_metrics(
        {"rollout/logprob_diff_max": [0.1, 0.3][r], "response_length/min": [4.0, 2.0][r], "reward/mean": [1.0, 2.0][r]}
    )
    stats = WeightedStats()
    if r == 0:
        stats.add({"actor/entropy": 1.0, "rollout/logprob_diff_max": 0.5}, weight=3)
        stats.add({"actor/entropy": 2.0, "rollout/logprob_diff_max": 0.2}, weight=1)
    else:  # a micro-batch of padding rows: no tokens
        stats.add({"actor/entropy": 0.0, "rollout/logprob_diff_max": 0.0}, weight=0)
    weighted = stats.result()
    if r == 0:
        torch.save({"step": step, "weighted": weighted}, out)
    distributed.teardown(together=True)


def test_metrics_of_two_ranks_take_max_min_and_token_weights(tmp_path):
    out = tmp_path / "metrics.pt"
    proc = torchrun([__file__, "metrics", str(out)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out)
    assert got["step"] == {"rollout/logprob_diff_max": 0.3, "response_length/min": 2.0, "reward/mean": 1.5}
    assert got["weighted"] == {"actor/entropy": pytest.approx((3 * 1.0 + 1 * 2.0) / 4), "rollout/logprob_diff_max": 0.5}


def test_grpo_under_torchrun_logs_once_checkpoints_and_resumes_exactly(tiny_model, tmp_path):
    import yaml
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    data = config(
        tiny_model,
        tmp_path / "unused",
        "fsdp",
        algorithm={"kl_coef": 0.01},
        sharding={"mixed_precision": "bf16", "activation_checkpointing": True},
        trainer={"steps": 3, "save_every": 2, "sample_every": 1, "lr": 1e-2},
        logging={"loggers": ["console", "jsonl"]},
    )
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(data))
    train = ["-m", "hybridrl.cli", "train", str(cfg)]

    straight = tmp_path / "straight"
    proc = torchrun([*train, f"trainer.run_dir={straight}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("step 3/3 | reward") == 1  # only rank 0 prints the step lines
    rows = metrics_rows(straight)
    assert [r["step"] for r in rows] == [1, 2, 3]  # one row per step: only rank 0 logs
    samples = [json.loads(line) for line in (straight / "samples.jsonl").read_text().splitlines()]
    first = [s for s in samples if s["step"] == 1]
    assert len(first) == 16 and len({s["prompt"] for s in first}) == 4  # both ranks' prompts, all samples
    step3 = straight / "checkpoints" / "step-000003"
    meta = json.loads((step3 / "meta.json").read_text())
    assert meta["sharding"] == "fsdp" and meta["world_size"] == 2
    assert (step3 / "sharded" / ".metadata").is_file() and (step3 / "rank-1.pt").is_file()

    # the HF folder gathered on rank 0 holds exactly the weights in the ranks' shards
    dcp_to_torch_save(step3 / "sharded", tmp_path / "consolidated.pt")
    shards = torch.load(tmp_path / "consolidated.pt", weights_only=True)["model"]
    exported = tmp_path / "exported"
    export = subprocess.run(
        [sys.executable, "-m", "hybridrl.cli", "export", str(step3), str(exported)], capture_output=True, text=True
    )
    assert export.returncode == 0, export.stderr
    hf = AutoModelForCausalLM.from_pretrained(exported).state_dict()
    assert hf.keys() == shards.keys()
    for key, value in shards.items():
        assert torch.equal(hf[key], value), key

    # stop after step 2, resume to 3: the same metrics as the straight run
    resumed = tmp_path / "resumed"
    proc = torchrun([*train, f"trainer.run_dir={resumed}", "trainer.steps=2"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc = torchrun([*train, f"trainer.run_dir={resumed}", "--resume"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("resumed from") == 1 and "step-000002" in proc.stdout
    again = metrics_rows(resumed)
    assert [r["step"] for r in again] == [1, 2, 3]
    assert_same_metrics(again, rows)


def test_dynamic_sampling_refill_under_torchrun(tiny_model, tmp_path):
    """Ranks keep different numbers of groups each round; they generate the same number of rounds
    (or hang) and, unless the rounds run out, each trains on its share of prompts_per_step."""
    import yaml

    data = config(tiny_model, tmp_path / "run", "fsdp", algorithm={"dynamic_sampling": True}, trainer={"steps": 3})
    data["rollout"]["refill_rounds"] = 3
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(data))
    proc = torchrun(["-m", "hybridrl.cli", "train", str(cfg)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = metrics_rows(tmp_path / "run")
    rounds = [r["rollout/rounds"] for r in rows]
    trained = [round(r["batch/trained_fraction"] * k * 16) for r, k in zip(rows, rounds)]  # 4 prompts x n=4
    assert len(rows) == 3 and all(1 <= k <= 4 for k in rounds)
    assert all(n == 16 for n, k in zip(trained, rounds) if k < 4)  # stopped early: every rank had its share
    assert all(n <= 16 for n in trained)


# -- in one process ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch, block", [("qwen2", "Qwen2DecoderLayer"), ("llama", "LlamaDecoderLayer"),
                                         ("phi3", "Phi3DecoderLayer"), ("gemma", "GemmaDecoderLayer"),
                                         ("gpt2", "GPT2Block")])  # fmt: skip
def test_blocks_come_from_the_model_itself(arch, block):
    from hybridrl.builtin.sharding_fsdp import find_blocks

    model = small_model(arch)
    assert [type(b).__name__ for b in find_blocks(model)] == [block] * 3
    model._no_split_modules = None  # a model that does not say: the entries of its largest ModuleList
    assert [type(b).__name__ for b in find_blocks(model)] == [block] * 3
    assert find_blocks(model, ["NoSuchLayer"]) == []


@pytest.fixture
def one_process_group():
    yield
    distributed.teardown()


def fsdp_strategy(tmp_path, **options):
    from hybridrl.builtin.sharding_fsdp import FSDPStrategy
    from hybridrl.components import RunContext

    ctx = RunContext("", None, torch.device("cpu"), torch.float32, 0, tmp_path)
    return FSDPStrategy(FSDPStrategy.Options(**options), ctx)


@pytest.mark.parametrize("arch", ["qwen2", "phi3"])
def test_fsdp_on_one_process_trains_and_gives_hf_names(arch, tmp_path, one_process_group):
    from transformers import AutoModelForCausalLM

    plain = small_model(arch)
    expected = {k: v.clone() for k, v in plain.state_dict().items()}
    strategy = fsdp_strategy(tmp_path, activation_checkpointing=True)
    model = strategy.wrap(small_model(arch).train())
    assert model.is_gradient_checkpointing
    full = dict(strategy.full_tensors(model))
    assert list(full) == list(expected)  # the names the HF state dict uses, tied weights under both
    for key in expected:
        assert torch.equal(full[key], expected[key]), key

    ids = torch.randint(3, 64, (2, 6))
    model(input_ids=ids, labels=ids).loss.backward()
    plain(input_ids=ids, labels=ids).loss.backward()
    norm = strategy.clip_grad_norm(model, 1e6)
    assert norm == pytest.approx(float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e6)), rel=1e-5)

    strategy.save_model(model, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [type(plain).__name__]  # not the FSDP wrapper class
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    for key in expected:
        assert torch.equal(reloaded[key], expected[key]), key


def test_fsdp_options_that_cannot_work_are_named(tmp_path):
    from hybridrl.builtin.sharding_fsdp import FSDPStrategy
    from hybridrl.components import RunContext

    ctx = RunContext("", None, torch.device("cpu"), torch.bfloat16, 0, tmp_path)
    with pytest.raises(ValueError, match="bfloat16 with sharding.mixed_precision: off .* no float32 master copy"):
        FSDPStrategy(FSDPStrategy.Options(mixed_precision="off"), ctx)
    from hybridrl.models import compute_dtype

    assert compute_dtype("auto", torch.bfloat16, ctx.device, "x") == torch.bfloat16  # float32 masters, bf16 compute
    ctx = dataclasses.replace(ctx, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"sharding.offload .* the policy is on cpu \(trainer.device\)"):
        FSDPStrategy(FSDPStrategy.Options(offload=True), ctx)
    with pytest.raises(ValueError, match="shard_group_size is for mode hybrid_shard"):
        FSDPStrategy(FSDPStrategy.Options(shard_group_size=2), ctx)


def under_torchrun(monkeypatch, world: int):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")


@pytest.mark.parametrize(
    "strategy, trainer, message",
    [
        ("single", {}, "sharding.strategy 'single' trains on one process, but torchrun started 2"),
        ("fsdp", {"prompts_per_step": 3}, "trainer.prompts_per_step=3 does not divide by the 2 ranks"),
        ("fsdp", {"mini_batch_size": 3}, "trainer.mini_batch_size=3 does not divide by the 2 ranks"),
    ],
)
def test_config_that_cannot_split_over_ranks_is_refused(tiny_model, tmp_path, monkeypatch, strategy, trainer, message):
    from hybridrl.config import ConfigError, load_config
    from hybridrl.run import build_run

    data = config(tiny_model, tmp_path / "run", strategy, trainer=trainer)
    data["rollout"]["n"] = 3  # 12 responses a step: a mini-batch of 3 is valid on one process
    cfg = load_config(data=data)
    under_torchrun(monkeypatch, 2)
    with pytest.raises(ConfigError, match=message):
        build_run(cfg)  # before any process group or model
    assert not distributed.initialized()


def test_torchrun_device_rules(monkeypatch):
    under_torchrun(monkeypatch, 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert devices.resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="trainer.device is 'cuda', but torch sees no CUDA device"):
            devices.resolve_device("cuda")


def test_contract_torchrun_placement_on_two_gpus(monkeypatch):
    """Contract test (no GPU here: torch is told it has two): under torchrun 'cuda' is the rank's own
    GPU for every option; an explicit index is that index on every node, except for the policy."""
    under_torchrun(monkeypatch, 4)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert devices.resolve_device("cuda", per_rank=True) == torch.device("cuda", 1)
    assert devices.resolve_device("cuda", "sharding.ref_device") == torch.device("cuda", 1)
    assert devices.resolve_device("cuda:0", "sharding.ref_device") == torch.device("cuda", 0)
    assert devices.resolve_device("auto", "rewards[0].device", auto=torch.device("cuda", 1)) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="trainer.device is 'cuda:0', but under torchrun each of the 4 ranks"):
        devices.resolve_device("cuda:0", per_rank=True)
    with pytest.raises(ValueError, match=r"sharding.ref_device is 'cuda:2', which does not exist: torch sees cuda:0"):
        devices.resolve_device("cuda:2", "sharding.ref_device")
    monkeypatch.setenv("LOCAL_RANK", "2")  # three processes on a node of two GPUs
    with pytest.raises(ValueError, match=r"LOCAL_RANK=2: run at most 2 processes per node"):
        devices.resolve_device("cuda", per_rank=True)


def test_two_launchers_of_one_node_each_train_as_two_nodes(tiny_model, tmp_path):
    """Multi-node is torchrun's rendezvous: two launchers (--nnodes 2, c10d on 127.0.0.1), one rank each."""
    from concurrent.futures import ThreadPoolExecutor

    import yaml
    from hybridrl_testing import free_port

    data = config(tiny_model, tmp_path / "run", "fsdp", trainer={"steps": 2}, logging={"loggers": ["console", "jsonl"]})
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(data))
    rdzv = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    rdzv += ["--rdzv-id", "hybridrl-two-nodes"]
    args = ["-m", "hybridrl.cli", "train", str(tmp_path / "cfg.yaml")]
    with ThreadPoolExecutor(2) as pool:
        nodes = list(pool.map(lambda _: torchrun(args, nproc=1, launcher=rdzv), range(2)))
    for proc in nodes:
        assert proc.returncode == 0, proc.stderr[-4000:]
    assert sum(proc.stdout.count("step 2/2 | reward") for proc in nodes) == 1  # rank 0 of node 0 prints
    rows = metrics_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step-000002" / "meta.json").read_text())
    assert meta["world_size"] == 2


def test_unavailable_reference_device_is_named(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from hybridrl.builtin.sharding_single import SingleDevice
    from hybridrl.components import RunContext

    ctx = RunContext("", None, torch.device("cpu"), torch.float32, 0, tmp_path)
    strategy = SingleDevice(SingleDevice.Options(ref_device="cuda:1"), ctx)
    with pytest.raises(ValueError, match="sharding.ref_device is 'cuda:1', but torch sees no CUDA device"):
        strategy.wrap_reference(small_model("llama"))


class ModelReward:
    """A reward whose small torch model sits on its ``device`` option while its inputs stay on the CPU."""

    def __init__(self, device):
        from types import SimpleNamespace

        self.options = SimpleNamespace(device=device)
        self.model = torch.nn.Linear(1, 1).to(device)

    def score(self, batch):
        lengths = torch.tensor([[float(len(r))] for r in batch["response_text"]])
        return self.model(lengths).squeeze(-1).tolist()


def test_device_clash_in_a_reward_names_the_reward_and_both_devices(tiny_model, tmp_path):
    from hybridrl.config import RewardConfig
    from hybridrl.errors import StageError
    from hybridrl.rewards import Rewards

    rewards = Rewards([(RewardConfig(function="rm", name="judge"), ModelReward("meta"))], torch.device("cpu"))
    batch = Batch()
    batch["response_text"] = ["7", "77"]
    batch["response_mask"] = torch.tensor([[1, 0], [1, 1]])
    with pytest.raises(StageError) as e:
        rewards.score(batch)
    message = str(e.value)
    assert "reward 'judge' (function 'rm')" in message and "tensors on different devices (cpu and meta)" in message
    assert "the policy (trainer.device) on cpu" in message and "Set rewards[0].device (now 'meta')" in message


def test_contract_cuda_device_message_is_translated():
    """Contract test: the message torch raises on CUDA (no GPU here) becomes one naming the component."""
    cuda_message = (
        "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cuda:1! "
        "(when checking argument for argument mat1 in method wrapper_CUDA_addmm)"
    )
    with pytest.raises(devices.DeviceError) as e:
        with devices.device_errors("reference model", {"its parameters": "cuda:1", "its inputs": "cuda:0"}):
            raise RuntimeError(cuda_message)
    assert str(e.value).startswith("reference model: tensors on different devices (cuda:0 and cuda:1)")
    assert "its parameters on cuda:1, its inputs on cuda:0" in str(e.value)
    with pytest.raises(KeyError):  # other errors pass through untouched
        with devices.device_errors("policy", {}):
            raise KeyError("x")


def stall_worker(config_path: str) -> None:
    """Under torchrun: train, with rank 1 stalling for a minute as the weight sync of step 2 begins."""
    import time

    from hybridrl.config import load_config
    from hybridrl.run import build_run
    from hybridrl.trainer import Trainer

    trainer = Trainer(build_run(load_config(config_path)))
    real = Trainer.step

    def step(self, n):
        if n == 2 and distributed.rank() == 1:
            sync = self.run.engine.update_weights

            def stalled(named_tensors):
                time.sleep(60)
                sync(named_tensors)

            self.run.engine.update_weights = stalled
        return real(self, n)

    Trainer.step = step
    trainer.train()


def test_a_stalled_rank_stops_the_others_after_the_timeout_naming_it(tiny_model, tmp_path):
    import yaml

    data = config(tiny_model, tmp_path / "run", "fsdp", trainer={"steps": 3, "timeout_s": 10})
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(data))
    proc = torchrun([__file__, "stall", str(tmp_path / "cfg.yaml")], timeout=120)  # a hang fails here
    assert proc.returncode != 0
    assert "step 2: rank 0 lost the other ranks in stage 'sync'" in proc.stderr, proc.stderr[-3000:]
    assert "Timed out waiting 10000ms" in proc.stderr  # the collective gave up after trainer.timeout_s
    assert "rank 1 most likely died or stalled" in proc.stderr and "trainer.timeout_s=10" in proc.stderr


if __name__ == "__main__" and sys.argv[1:2] == ["stall"]:
    stall_worker(sys.argv[2])
if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker(*sys.argv[2:4])
    exit_rank(0)  # the rank's work is done: without the teardown that was seen to abort it
if __name__ == "__main__" and sys.argv[1:2] == ["metrics"]:
    metrics_worker(sys.argv[2])
    exit_rank(0)


def test_ranks_that_finished_leave_the_process_group_together(monkeypatch):
    """A run that ended normally waits for every rank before destroying the group (a rank that left
    while rank 0 still wrote the final checkpoint was seen to abort at its exit); a failed run does not
    wait, since the other ranks may never come."""
    calls = []
    monkeypatch.setattr(distributed, "_owned", True)
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed.dist, "barrier", lambda *a, **k: calls.append("barrier"))
    monkeypatch.setattr(distributed.dist, "destroy_process_group", lambda *a, **k: calls.append("destroy"))
    distributed.teardown(together=True)
    assert calls == ["barrier", "destroy"]
    calls.clear()
    monkeypatch.setattr(distributed, "_owned", True)
    distributed.teardown()
    assert calls == ["destroy"]


def test_train_leaves_together_only_when_the_run_finished(tiny_model, tmp_path, monkeypatch):
    """Trainer.train asks the ranks to leave together after its last step, not after a failure."""
    from hybridrl.config import load_config
    from hybridrl.run import build_run
    from hybridrl.trainer import Trainer

    left = []
    monkeypatch.setattr(distributed, "teardown", lambda together=False: left.append(together))
    cfg = config(tiny_model, tmp_path / "ok", trainer={"save_final": False, "eval_before_train": False})
    Trainer(build_run(load_config(data=cfg))).train()
    assert left == [True]
    failing = Trainer(
        build_run(load_config(data=config(tiny_model, tmp_path / "failed", trainer={"save_final": False})))
    )
    monkeypatch.setattr(failing, "step", lambda step: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.train()
    assert left == [True, False]
