"""The policy's LoRA adapter served by SGLang's own LoRA support: contract tests.

SGLang is the contract fake (conftest.py): its LoRA API as SGLang 0.5.x has it, in this process
(``load_lora_adapter_from_tensors``, ``load_lora_adapter``, ``unload_lora_adapter``, ``lora_path`` in
``generate``) and as a server (``/get_server_info``, ``/load_lora_adapter``, ``/unload_lora_adapter``).
The trainer, peft's adapters, GRPO and the sync check are real.
"""

import pytest
from hybridrl_testing import SevensPlugin, metrics_rows

from hybridrl.config import ConfigError, load_config
from hybridrl.run import build_run
from hybridrl.trainer import Trainer

pytest.importorskip("peft", reason="peft is not installed: pip install 'hybridrl[lora]'")

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def config(model, run_dir, rollout, sync="adapter", steps=2):
    return {
        "model": {"path": model, "lora": LORA | {"sync": sync}},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 32},
        "rollout": {"engine": "sglang", "n": 4, "max_tokens": 10, "sync_check_every": 1, **rollout},
        "rewards": [{"function": "sevens"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.01},
        "trainer": {
            "steps": steps,
            "prompts_per_step": 2,
            "lr": 5e-2,
            "seed": 0,
            "device": "cpu",
            "run_dir": str(run_dir),
        },  # fmt: skip
        "logging": {"loggers": ["jsonl"]},
    }


@pytest.mark.parametrize("from_tensors", [True, False], ids=["tensors", "folder"])
def test_in_process_sglang_serves_the_adapter_alone_and_stays_on_policy(
    from_tensors, tiny_model, tmp_path, sglang_module, register_plugin, capsys, monkeypatch
):
    if not from_tensors:  # an SGLang without load_lora_adapter_from_tensors: peft's folder
        monkeypatch.delattr(sglang_module.Engine, "load_lora_adapter_from_tensors")
    register_plugin(SevensPlugin(), name="sevens")
    run = tmp_path / "run"
    Trainer(build_run(load_config(data=config(tiny_model, run, {})))).train()

    assert "LoRA sync: the adapter alone" in capsys.readouterr().out
    engine = sglang_module.Engine.last
    assert {k: engine.kwargs[k] for k in ("enable_lora", "max_lora_rank", "lora_target_modules")} == {
        "enable_lora": True, "max_lora_rank": 4, "lora_target_modules": ["q_proj", "v_proj"]}  # fmt: skip
    # the base weights released while the policy trains come back from SGLang's CPU copy
    assert engine.kwargs["enable_weights_cpu_backup"] is True
    calls = [c for c in engine.core.calls if c[0] in ("load_lora_adapter", "unload_lora_adapter", "generate")]
    loads = [c[1] for c in calls if c[0] == "load_lora_adapter"]
    assert loads == ["policy-v0-1", "policy-v1-2", "policy-v2-3"]  # at setup, then after each update
    assert [c[1] for c in calls if c[0] == "unload_lora_adapter"] == loads[:-1]
    assert engine.core.adapters.keys() == {"policy-v2-3"} and not any(c[0] == "update_weights_from_tensor"
                                                                       for c in engine.core.calls)  # fmt: skip
    # every generate after the setup asks for the adapter loaded last
    served = [c[2] if len(c) > 2 else None for c in calls if c[0] == "generate"]
    assert all(s is not None for s in served)
    for r in metrics_rows(run):  # the engine samples with the trainer's weights, before and after each sync
        assert r["rollout/logprob_diff_max"] < 1e-4 and r["rollout/sync_check_diff_max"] < 1e-4


def test_an_sglang_server_with_lora_takes_the_adapter_alone(tiny_model, tmp_path, sglang_server, register_plugin):
    sglang_server.core.lora = {"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["all"]}
    register_plugin(SevensPlugin(), name="sevens")
    run = tmp_path / "run"
    Trainer(build_run(load_config(data=config(tiny_model, run, {"base_url": sglang_server.url})))).train()

    paths = [p for p, _ in sglang_server.requests]
    assert paths.count("/load_lora_adapter") == 3 and paths.count("/unload_lora_adapter") == 2
    assert "/update_weights_from_disk" not in paths
    last = [b for p, b in sglang_server.requests if p == "/generate"][-1]
    assert last["lora_path"] == ["policy-v2-3"] * len(last["input_ids"]) and sglang_server.core.adapters.keys() == {
        "policy-v2-3"}  # fmt: skip
    assert sorted(p.name for p in (run / "sglang_weights" / "adapters").iterdir()) == ["policy-v2-3"]
    for r in metrics_rows(run):
        assert r["rollout/logprob_diff_max"] < 1e-4 and r["rollout/sync_check_diff_max"] < 1e-4


@pytest.mark.parametrize(
    ("lora", "why"),
    [
        ({}, "the server was started without --enable-lora"),
        ({"enable_lora": True, "max_lora_rank": 2, "lora_target_modules": ["all"]},
         "its max_lora_rank is 2, below the adapter's rank 4"),
        ({"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["q_proj"]},
         "its lora_target_modules lack v_proj"),
    ],
    ids=["lora off", "rank", "targets"],
)  # fmt: skip
def test_a_server_that_cannot_serve_the_adapter_gets_merged_weights_or_stops_the_run(
    lora, why, tiny_model, tmp_path, sglang_server, register_plugin, capsys
):
    sglang_server.core.lora = lora
    register_plugin(SevensPlugin(), name="sevens")
    run = tmp_path / "run"
    Trainer(build_run(load_config(data=config(tiny_model, run, {"base_url": sglang_server.url}, "auto", 1)))).train()
    assert f"LoRA sync: merged weights to rollout engine 'sglang' ({why}" in capsys.readouterr().out
    assert [p for p, _ in sglang_server.requests].count("/update_weights_from_disk") == 1
    with pytest.raises(ConfigError, match=f"model.lora.sync is 'adapter', but rollout engine 'sglang' cannot take "
                                          f"adapters: {why}"):  # fmt: skip
        build_run(load_config(data=config(tiny_model, tmp_path / "run2", {"base_url": sglang_server.url})))
