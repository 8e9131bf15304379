"""hybridrl tenants: several LoRA adapters over one frozen base, in one run, on the tiny random Llama
with the hf engine: each tenant learns its own reward from its own data, with its own optimizer, folder
and checkpoints; one tenant alone is the plain LoRA run; a resume repeats the run."""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch
import yaml
from hybridrl_testing import SevensPlugin, assert_same_metrics, build_tiny_model, metrics_rows

from hybridrl.cli import main
from hybridrl.components import RewardFunction
from hybridrl.errors import ConfigError
from hybridrl.hookspecs import hookimpl


class OnesReward(RewardFunction):
    """Fraction of response characters that are '1'."""

    def score(self, batch):
        return [r.count("1") / max(1, len(r)) for r in batch["response_text"]]


class OnesPlugin:
    @hookimpl
    def register_reward_functions(self, register):
        register("ones", OnesReward)


@pytest.fixture
def rewards(register_plugin):
    register_plugin(SevensPlugin(), name="sevens")
    register_plugin(OnesPlugin(), name="ones")


def main_raising(argv: list[str]):
    """The command's function itself: its errors raised, not printed."""
    import argparse

    from hybridrl_tenants.command import add_command

    parser = argparse.ArgumentParser()
    add_command(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


def own(row: dict, name: str) -> dict:
    """A row of the run's metrics.jsonl: the tenant's metrics, their names without the tenant's."""
    return {k.removeprefix(f"{name}/"): v for k, v in row.items() if k.startswith(f"{name}/")} | {"step": row["step"]}


def config(model, run_dir, tenants: dict | None = None, **trainer) -> dict:
    data = {"source": "reasoning_gym", "task": "chain_sum", "size": 64, "chat_template": True}
    return {
        "model": {"path": model, "lora": {"r": 8, "alpha": 16, "target_modules": "all-linear", "sync": "adapter"}},
        "data": data,
        "rollout": {"engine": "hf", "n": 4, "max_tokens": 12, "sync_check": 1e-3},
        "rewards": [{"function": "sevens"}],
        "algorithm": {"name": "grpo"},
        "trainer": {"steps": 4, "prompts_per_step": 4, "lr": 5e-3, "seed": 0, "run_dir": str(run_dir), **trainer},
        "logging": {"loggers": ["jsonl"]},
        **({"tenants": tenants} if tenants is not None else {}),
    }


def write(tmp_path, cfg: dict, name: str = "run.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


class Views:
    """Each tenant's view of the run, as on_train_start and on_train_end get it, and the base's weights then."""

    def __init__(self):
        self.policies, self.base = [], []

    @hookimpl
    def on_train_start(self, run):
        self.policies.append(run.policy)
        self.base.append({n: p.detach().clone() for n, p in run.policy.named_parameters() if "lora_" not in n})

    @hookimpl
    def on_train_end(self, run):
        self.base.append({n: p.detach().clone() for n, p in run.policy.named_parameters() if "lora_" not in n})


def chars(run_dir, name: str, char: str, steps) -> float:
    """The fraction of ``char`` in the tenant's sampled responses of ``steps``."""
    rows = [json.loads(line) for line in (run_dir / "tenants" / name / "samples.jsonl").read_text().splitlines()]
    text = "".join(r["response"] for r in rows if r["step"] in steps)
    return text.count(char) / max(1, len(text))


def test_two_tenants_learn_their_own_rewards_over_one_frozen_base(tiny_model, tmp_path, rewards, register_plugin):
    """Two tenants, the same prompts, each its own reward: after 16 steps each writes more of its own digit
    than the other does. The engine samples each step with the tenant's adapter (the sync check), one policy
    serves both, and its base weights never change."""
    from safetensors.torch import load_file

    views = register_plugin(Views(), name="views")
    run_dir, lr = tmp_path / "run", {"lr": 1e-1}
    tenants = {"sevens": {"trainer": lr}, "ones": {"rewards": [{"function": "ones"}], "trainer": lr}}
    cfg = config(tiny_model, run_dir, tenants, steps=16, sample_every=1, prompts_per_step=8, save_final=True)
    assert main(["tenants", write(tmp_path, cfg)]) == 0
    late = range(13, 17)
    assert chars(run_dir, "sevens", "7", late) > 2 * chars(run_dir, "ones", "7", late)
    assert chars(run_dir, "ones", "1", late) > 2 * chars(run_dir, "sevens", "1", late)
    for name in tenants:
        rows = metrics_rows(run_dir / "tenants" / name)
        assert [r["step"] for r in rows] == list(range(1, 17))
        assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-4  # the engine sampled with this tenant's adapter
    top = metrics_rows(run_dir)  # the run's record: every tenant's metrics, under its name
    assert [r["step"] for r in top] == list(range(1, 17))
    assert top[-1]["ones/reward/mean"] == rows[-1]["reward/mean"] and "sevens/reward/mean" in top[-1]
    assert len(views.policies) == 2 and views.policies[0] is views.policies[1]  # one base in memory
    assert all(b.keys() == views.base[0].keys() for b in views.base) and len(views.base) == 4
    for before_after in views.base[1:]:
        assert all(torch.equal(before_after[n], t) for n, t in views.base[0].items())
    saved = "checkpoints/step-000016/policy/adapter_model.safetensors"
    adapters = [load_file(run_dir / "tenants" / n / saved) for n in tenants]
    assert adapters[0].keys() == adapters[1].keys()  # the checkpoint holds the tenant's adapter alone
    assert all(not torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0] if "lora_B" in k)
    assert json.loads((run_dir / "tenants.json").read_text()) == {"step": 16, "tenants": ["ones", "sevens"]}


def test_one_tenant_is_the_plain_lora_run(tiny_model, tmp_path, rewards):
    """A tenant alone, with the top-level data and rewards, trains as hybridrl train trains the adapter: the
    same metrics at every step."""
    plain = config(tiny_model, tmp_path / "plain")
    assert main(["train", write(tmp_path, plain, "plain.yaml")]) == 0
    alone = config(tiny_model, tmp_path / "alone", {"only": {}})
    assert main(["tenants", write(tmp_path, alone, "alone.yaml")]) == 0
    want = metrics_rows(tmp_path / "plain")
    assert_same_metrics(metrics_rows(tmp_path / "alone" / "tenants" / "only"), want, rel=0, abs=0)
    assert want[-1]["reward/mean"] > 0 and want[-1]["rollout/logprob_diff_max"] < 1e-4


def test_a_tenant_starts_from_its_own_adapter_folder_as_a_run_from_that_folder_does(tiny_model, tmp_path, rewards):
    """A tenant with lora_path trains as hybridrl train with model.lora.path does: the same metrics each step.
    A folder of another rank, or of another base model, or no adapter folder: one line naming the tenant, before
    any step, nothing of any tenant written."""
    first = tmp_path / "first"
    assert main(["train", write(tmp_path, config(tiny_model, first, steps=2, save_final=True), "first.yaml")]) == 0
    folder = str(first / "checkpoints" / "step-000002" / "policy")
    plain = config(tiny_model, tmp_path / "plain")
    plain["model"]["lora"] = {"path": folder, "sync": "adapter"}
    assert main(["train", write(tmp_path, plain, "plain.yaml")]) == 0
    alone = config(tiny_model, tmp_path / "alone", {"only": {"lora_path": folder}, "fresh": {}})
    assert main(["tenants", write(tmp_path, alone, "alone.yaml")]) == 0
    assert_same_metrics(
        metrics_rows(tmp_path / "alone" / "tenants" / "only"), metrics_rows(tmp_path / "plain"), rel=0, abs=0
    )

    other = config(tiny_model, tmp_path / "other", steps=1, save_final=True)
    other["model"]["lora"] |= {"r": 4}
    assert main(["train", write(tmp_path, other, "other.yaml")]) == 0
    rank4 = str(tmp_path / "other" / "checkpoints" / "step-000001" / "policy")
    cases = [
        (rank4, r"tenants.b.lora_path '.*' has r 4 where this run's adapters have 8 \(model.lora\): every tenant"),
        (str(tmp_path), r"tenants.b.lora_path '.*' has no adapter_config.json: it must be a peft adapter folder"),
    ]
    for path, error in cases:
        cfg = config(tiny_model, tmp_path / "bad", {"a": {}, "b": {"lora_path": path}})
        with pytest.raises(ConfigError, match=error):
            main_raising(["tenants", write(tmp_path, cfg, "bad.yaml")])
        assert not (tmp_path / "bad" / "tenants").exists()


def test_a_tenants_folder_from_another_base_model_is_refused_in_one_line(tiny_model, checkpoints, tmp_path, rewards):
    qwen = config(checkpoints["qwen2"], tmp_path / "qwen", steps=1, save_final=True)
    assert main(["train", write(tmp_path, qwen, "qwen.yaml")]) == 0
    folder = str(tmp_path / "qwen" / "checkpoints" / "step-000001" / "policy")
    cfg = config(tiny_model, tmp_path / "bad", {"a": {}, "b": {"lora_path": folder}})
    with pytest.raises(ConfigError, match=r"tenants.b.lora_path '.*'.* it was trained on another base model"):
        main_raising(["tenants", write(tmp_path, cfg, "bad.yaml")])
    assert not (tmp_path / "bad" / "tenants").exists()


TWO = {
    "sevens": {"trainer": {"lr": 5e-2}},
    "ones": {"data": {"seed": 7}, "rewards": [{"function": "ones"}], "trainer": {"lr": 1e-1, "seed": 3}},
}


class Interrupt:
    """Ctrl-C during the first tenant's step 2, once."""

    fired = False

    @hookimpl
    def on_step_end(self, run, step):
        if step == 2 and run.run_dir.name == "ones" and not self.fired:
            self.fired = True
            os.kill(os.getpid(), signal.SIGINT)


def test_a_resume_repeats_the_run_from_the_step_every_tenant_saved(
    tiny_model, tmp_path, rewards, register_plugin, capsys
):
    """Four steps straight, against Ctrl-C in step 2 (every tenant ends the step and saves it) and a resume;
    and against a kill between two tenants' checkpoints of step 4 (one tenant has step 4, the other not,
    the marker says 2): the resume takes both from step 2 and repeats steps 3 and 4."""
    whole = tmp_path / "whole"
    assert main(["tenants", write(tmp_path, config(tiny_model, whole, TWO, save_every=2), "whole.yaml")]) == 0
    parts = tmp_path / "parts"
    path = write(tmp_path, config(tiny_model, parts, TWO, save_every=3), "parts.yaml")
    register_plugin(Interrupt(), name="interrupt")
    assert main(["tenants", path]) == 130
    assert f"stopped by SIGINT after step 2; checkpoint {parts / 'tenants.json'}" in capsys.readouterr().err
    assert json.loads((parts / "tenants.json").read_text())["step"] == 2
    assert main(["tenants", path, "--resume"]) == 0
    for name in TWO:
        want = metrics_rows(whole / "tenants" / name)
        assert_same_metrics(metrics_rows(parts / "tenants" / name), want, rel=0, abs=0)
    for name in TWO:  # the run's record, every tenant's under its name
        got, want = ([own(r, name) for r in metrics_rows(d)] for d in (parts, whole))
        assert_same_metrics(got, want, rel=0, abs=0)

    (whole / "tenants.json").write_text(json.dumps({"step": 2, "tenants": ["ones", "sevens"]}))
    shutil.rmtree(whole / "tenants" / "sevens" / "checkpoints" / "step-000004")  # killed before sevens saved
    first = {n: metrics_rows(whole / "tenants" / n) for n in TWO}
    assert main(["tenants", str(tmp_path / "whole.yaml"), "--resume"]) == 0
    for name in TWO:
        assert_same_metrics(metrics_rows(whole / "tenants" / name), first[name], rel=0, abs=0)
        assert (whole / "tenants" / name / "checkpoints" / "step-000004").is_dir()
    assert json.loads((whole / "tenants.json").read_text())["step"] == 4

    renamed = {"sevens": TWO["sevens"], "twos": TWO["ones"]}
    path = write(tmp_path, config(tiny_model, whole, renamed), "renamed.yaml")
    with pytest.raises(ConfigError, match=r"holds the tenants ones, sevens and this config names sevens, twos"):
        main_raising(["tenants", path, "--resume"])


def test_a_tenants_eval_sets_are_evaluated_into_its_own_record(tiny_model, tmp_path, rewards):
    """A tenant's data.eval sets run before training and at trainer.eval_every; their metrics go
    to its own record and, under its name, the run's; a tenant without sets evaluates nothing."""
    held = {"name": "held", "source": "reasoning_gym", "task": "chain_sum", "size": 6, "seed": 1}
    tenants = {"sevens": {}, "ones": {"data": {"eval": [held]}, "rewards": [{"function": "ones"}]}}
    run_dir = tmp_path / "run"
    assert main(["tenants", write(tmp_path, config(tiny_model, run_dir, tenants, steps=2, eval_every=2))]) == 0
    ones = [r for r in metrics_rows(run_dir / "tenants" / "ones") if "eval/held/mean@1" in r]
    assert [r["step"] for r in ones] == [0, 2] and (
        run_dir / "tenants" / "ones" / "eval" / "step-000002-held.jsonl"
    ).is_file()
    assert not any(k.startswith("eval/") for r in metrics_rows(run_dir / "tenants" / "sevens") for k in r)
    top = [r for r in metrics_rows(run_dir) if "ones/eval/held/mean@1" in r]
    assert [r["step"] for r in top] == [0, 2] and top[1]["ones/eval/held/mean@1"] == ones[1]["eval/held/mean@1"]


@pytest.mark.parametrize(
    "change, error",
    [
        ({"tenants": {"Math": {}, "math": {}}}, r"tenants 'Math' and 'math' collide: their folders are one"),
        ({"tenants": {"a/b": {}}}, r"tenant name 'a/b': up to 64 letters, digits"),
        ({"tenants": {"a": {"trainer": {"steps": 3}}}}, r"trainer.steps is the run's, the same for every tenant"),
        ({"tenants": {"a": {"model": {"path": "x"}}}}, r"tenant 'a' sets 'model': a tenant sets data, rewards"),
        ({"tenants": {}}, r"the config names no tenants"),
        ({"model": {"lora": None}}, r"trains a LoRA adapter per tenant over one frozen base: set model.lora"),
        ({"rollout": {"async": 1}}, r"rollout.async is 1: the tenants take their steps in turn"),
        ({"tenants": {"a": {}, "b": {"data": {"prompt_column": "nope"}}}}, r"tenant 'b': .*nope"),
        ({"tenants": {"a": {}, "b": {"rewards": [{"function": "sevns"}]}}}, r"tenants.b: .*sevns.*sevens"),
    ],
    ids=["names-collide", "bad-name", "shared-key", "unknown-key", "none", "no-lora", "async", "data", "reward"],
)
def test_bad_tenants_fail_in_one_line_before_any_model_loads(tiny_model, tmp_path, rewards, change, error):
    cfg = config(tiny_model, tmp_path / "run", {"a": {}})
    for section, value in change.items():
        cfg[section] = value if section == "tenants" else {**cfg[section], **value}
    with pytest.raises(ConfigError, match=error) as e:
        main_raising(["tenants", write(tmp_path, cfg)])
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()  # nothing written, of any tenant


def test_a_resume_without_its_run_directory_is_refused(tiny_model, tmp_path, rewards):
    cfg = config(tiny_model, tmp_path / "run", TWO)
    del cfg["trainer"]["run_dir"]
    with pytest.raises(ConfigError, match=r"--resume needs trainer.run_dir: the directory of the tenants' run"):
        main_raising(["tenants", write(tmp_path, cfg), "--resume"])


def test_hybridrl_train_refuses_a_config_with_tenants(tiny_model, tmp_path, rewards, capsys):
    assert main(["train", write(tmp_path, config(tiny_model, tmp_path / "run", TWO))]) == 2
    said = capsys.readouterr().err
    assert "this config trains the tenants ones, sevens: run it with 'hybridrl tenants CONFIG'" in said


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from hybridrl_testing.models import ARCHITECTURES, build_checkpoint

    return {arch: build_checkpoint(tmp_path_factory.mktemp(arch), arch) for arch in ARCHITECTURES}


FAMILIES = ["llama", "phi3", "phi3-su", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3", "mistral", "gpt2"]
CASES = [(arch, "adapter") for arch in FAMILIES] + [(arch, "merged") for arch in ("qwen3_moe", "gemma2", "gpt2")]


@pytest.mark.parametrize("arch, sync", CASES, ids=[f"{a}-{s}" for a, s in CASES])
def test_every_family_serves_each_tenant_its_own_adapter(arch, sync, checkpoints, tmp_path, rewards):
    """Each family as its checkpoints ship (tied and untied output layers, MoE, GPT-2's Conv1D), with the adapter
    alone or merged weights sent at each switch of tenant: the engine's logprobs are the tenant's policy's
    at every step and after every sync."""
    cfg = config(checkpoints[arch], tmp_path / "run", TWO, steps=2)
    cfg["model"]["lora"]["sync"] = sync
    cfg["rollout"] |= {"sync_check_every": 1, "max_tokens": 16}
    assert main(["tenants", write(tmp_path, cfg)]) == 0
    for name in TWO:
        rows = metrics_rows(tmp_path / "run" / "tenants" / name)
        assert [r["step"] for r in rows] == [1, 2]
        for r in rows:
            assert r["rollout/logprob_diff_max"] < 1e-4 and r["rollout/sync_check_diff_max"] < 1e-4, (name, r["step"])


class Calls:
    """Counts the engine's generate calls, and the adapters each named."""

    def __init__(self):
        self.calls, self.engine = [], None

    @hookimpl
    def on_train_start(self, run):
        if self.engine is None:
            self.engine = run.engine
            generate = run.engine.generate

            def counted(prompts, sampling):
                held = sorted(run.engine.backend.adapters.named)  # the adapters vLLM holds for the call
                self.calls.append((len(prompts), sampling.max_tokens, sampling.adapters, held))
                return generate(prompts, sampling)

            run.engine.generate = counted


def test_vllm_answers_every_tenants_prompts_in_one_call_with_their_adapters(
    tmp_path_factory, tmp_path, rewards, register_plugin
):
    """Each tenant's prompts answered by its adapter, loaded side by side in vLLM, one call a step for all."""
    pytest.importorskip("vllm")
    model = build_tiny_model(tmp_path_factory.mktemp("tiny-llama-h128"), hidden=128)
    calls = register_plugin(Calls(), name="calls")
    cfg = config(str(model), tmp_path / "run", TWO, steps=3)
    cfg["rollout"] = {"engine": "vllm", "n": 4, "max_tokens": 12, "max_model_len": 256, "sync_check_every": 1}
    assert main(["tenants", write(tmp_path, cfg)]) == 0
    for name in TWO:
        rows = metrics_rows(tmp_path / "run" / "tenants" / name)
        assert [r["step"] for r in rows] == [1, 2, 3]
        for r in rows:  # each prompt sampled by its own tenant's adapter, each step
            assert r["rollout/logprob_diff_max"] < 1e-4 and r["rollout/sync_check_diff_max"] < 1e-4, (name, r)
    steps = [c for c in calls.calls if c[1] == 12]  # the steps' rollouts (the sync check's probes take 1 token)
    assert len(steps) == 3  # one call a step for both tenants
    assert all(c[0] == 8 and c[2] == ["ones"] * 4 + ["sevens"] * 4 and c[3] == ["ones", "sevens"] for c in steps)
