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
    assert "/update_weights_from_disk" not in paths
    loads = [b["lora_name"] for p, b in sglang_server.requests if p == "/load_lora_adapter"]
    assert [n.rsplit("-", 1)[0] for n in loads] == ["policy-v0-1", "policy-v1-2", "policy-v2-3"]
    last = [b for p, b in sglang_server.requests if p == "/generate"][-1]
    assert last["lora_path"] == [loads[-1]] * len(last["input_ids"])  # the newest, while the run went on
    # each unloaded once unused, the last as the run ended: the server and weights_dir hold none of them
    assert [b["lora_name"] for p, b in sglang_server.requests if p == "/unload_lora_adapter"] == loads
    assert not sglang_server.core.adapters and not any((run / "sglang_weights" / "adapters").iterdir())
    for r in metrics_rows(run):
        assert r["rollout/logprob_diff_max"] < 1e-4 and r["rollout/sync_check_diff_max"] < 1e-4
    # a run killed before its end leaves its adapter loaded; the next run's names are its own
    sglang_server.core.adapters[loads[-1]] = ({}, {})  # as the server still holds it
    again = tmp_path / "again" / "run"
    Trainer(build_run(load_config(data=config(tiny_model, again, {"base_url": sglang_server.url})))).train()
    assert sglang_server.core.adapters.keys() == {loads[-1]}  # the leftover alone


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


def seeded_adapter(model_path, seed: int, version: int):
    """The policy's adapter (r 4 on q_proj and v_proj) with seeded factors (peft starts B at 0), and the
    model it makes."""
    from types import SimpleNamespace

    import torch
    from peft import LoraConfig, get_peft_model

    from hybridrl import lora
    from hybridrl.models import load_causal_lm

    model = get_peft_model(
        load_causal_lm(model_path, torch.float32, torch.device("cpu")),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    single = SimpleNamespace(full_tensors=lambda m, keep: ((n, t) for n, t in m.state_dict().items() if keep(n)))
    return lora.adapter(single, model, version), model.eval()


@pytest.mark.parametrize("most", [None, 2], ids=["unbounded", "max-loaded-loras-2"])
def test_adapter_syncs_load_beside_the_adapter_a_request_in_flight_uses_which_serves_it_to_the_end(
    most, tiny_model, tmp_path, sglang_server, make_engine, prompts
):
    """Two adapter syncs while a request runs on a server: neither waits for it (no pause: SGLang serves
    several adapters at once), the request is served to its end by the adapter it started on (its tokens
    say so, and their logprobs are that adapter's), which is unloaded once it is done; the one loaded
    between, which nothing used, goes at once. A server that holds two adapters (--max-loaded-loras 2)
    evicts the oldest itself once its request is done: the second sync waits for that."""
    import threading
    import time

    import torch

    from hybridrl.batch import Batch
    from hybridrl.components import SamplingParams
    from hybridrl.passes import response_logprobs

    core = sglang_server.core
    core.lora = {"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["all"], "max_loaded_loras": most}
    engine = make_engine(base_url=sglang_server.url, weights_dir=str(tmp_path / "w"))
    (first, policy), second, third = (seeded_adapter(tiny_model, s, v) for s, v in ((1, 1), (2, 2), (3, 3)))
    engine.update_adapter(first)
    assert engine.updates_in_flight()  # adapters load beside each other
    reached, synced, steps, seen = threading.Event(), threading.Event(), [], {}

    def hook(core):  # the sixth token: hold the request (the lock released) until both syncs returned
        steps.append(1)
        if len(steps) == 6:
            reached.set()
            deadline = time.monotonic() + (30 if most is None else 1)
            while not synced.is_set() and time.monotonic() < deadline:
                core.cond.wait(0.01)  # the lock released meanwhile
            seen["synced_in_flight"] = synced.is_set()

    core.step_hook = hook
    out = {}
    sampling = SamplingParams(n=1, max_tokens=16, temperature=1.0, ignore_eos=True)
    thread = threading.Thread(target=lambda: out.setdefault("out", engine.generate(prompts[:1], sampling)))
    thread.start()
    assert reached.wait(60)
    engine.update_adapter(second[0])
    engine.update_adapter(third[0])
    synced.set()
    thread.join(60)
    assert seen["synced_in_flight"] is (most is None)  # the syncs did not wait for the request, where room
    result = out["out"]
    assert result.token_versions == [[1] * 16]  # every token served by the adapter of sync 1
    flow = [c for c in core.calls if c[0] in ("load_lora_adapter", "unload_lora_adapter", "evict_lora_adapter")]
    names = [c[1] for c in flow if c[0] == "load_lora_adapter"]
    if most is None:  # the second, never used, goes at the third's load; the first once its request is done
        assert flow[-2:] == [("unload_lora_adapter", names[1]), ("unload_lora_adapter", names[0])]
    else:  # the first went once its request was done: evicted by the third's load, or unloaded by the engine
        # where that came first (both race, and neither fails); then the engine unloads the second
        gone = [c for c in flow if c[1] == names[0] and c[0] != "load_lora_adapter"]
        assert len(gone) == 1 and flow[-1] == ("unload_lora_adapter", names[1])
    assert core.adapters.keys() == {names[2]} and engine.loaded == {names[2]: 3}
    batch = Batch.from_rollout(prompts[:1], result, 1, pad_id=0)
    with torch.no_grad():
        lp, _ = response_logprobs(policy, batch.input_ids, batch.attention_mask, 16, 1.0)
    assert (lp - batch["rollout_logprobs"]).abs().max().item() < 1e-4


def test_one_call_mixes_adapters_of_several_names_each_request_with_its_own(
    tiny_model, tmp_path, sglang_server, make_engine, prompts
):
    """Adapters of two names (hybridrl tenants): both stay loaded, a call's prompts each ask for the newest of
    their own (one request, SGLang mixing them in its batches), each response is sampled by its adapter and
    labelled with the sync that loaded it; a newer adapter of one name replaces only that name's."""
    import torch

    from hybridrl.batch import Batch
    from hybridrl.components import SamplingParams
    from hybridrl.passes import response_logprobs

    core = sglang_server.core
    core.lora = {"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["all"], "max_loras_per_batch": 4}
    engine = make_engine(base_url=sglang_server.url, weights_dir=str(tmp_path / "w"))
    (a, policy_a), (b, policy_b) = seeded_adapter(tiny_model, 1, 1), seeded_adapter(tiny_model, 2, 1)
    a.name, b.name = "a", "b"
    engine.update_adapter(a)
    engine.update_adapter(b)
    assert engine.adapters_per_call() == 4  # the server's max_loras_per_batch
    sampling = SamplingParams(n=2, max_tokens=8, temperature=1.0, ignore_eos=True, seed=3, adapters=["a", "b", "a"])
    out = engine.generate(prompts[:3], sampling)
    request = [body for path, body in sglang_server.requests if path == "/generate"][-1]
    assert [n.split("-")[0] for n in request["lora_path"]] == ["a", "a", "b", "b", "a", "a"]
    assert out.token_versions == [[1] * 8] * 2 + [[2] * 8] * 2 + [[1] * 8] * 2  # the syncs that loaded each
    batch = Batch.from_rollout(prompts[:3], out, 2, pad_id=0)
    for rows, policy in (([0, 1, 4, 5], policy_a), ([2, 3], policy_b)):
        with torch.no_grad():
            lp, _ = response_logprobs(policy, batch.input_ids[rows], batch.attention_mask[rows], 8, 1.0)
        assert (lp - batch["rollout_logprobs"][rows]).abs().max().item() < 1e-4
    newer = seeded_adapter(tiny_model, 3, 2)[0]
    newer.name = "a"
    engine.update_adapter(newer)  # the older a goes, nothing in flight using it; b stays, its name's newest
    assert sorted(n.split("-")[0] + n.split("-")[1] for n in core.adapters) == ["av2", "bv1"]


def test_tenants_through_an_sglang_server_share_one_call_a_step(tiny_model, tmp_path, sglang_server, register_plugin):
    """hybridrl tenants over an SGLang server: a step's prompts of both tenants in one /generate, each asking
    for its tenant's newest adapter; each tenant's engine logprobs and sync check are its own policy's."""
    pytest.importorskip("hybridrl_tenants")
    import yaml

    from hybridrl.cli import main

    sglang_server.core.lora = {"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["all"]}
    register_plugin(SevensPlugin(), name="sevens")
    cfg = config(tiny_model, tmp_path / "run", {"base_url": sglang_server.url}, steps=2)
    cfg["tenants"] = {"one": {"trainer": {"lr": 5e-2}}, "two": {"trainer": {"lr": 1e-1, "seed": 1}}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    sglang_server.requests.clear()
    assert main(["tenants", str(tmp_path / "run.yaml")]) == 0
    steps = [b for p, b in sglang_server.requests if p == "/generate" and b["sampling_params"]["max_new_tokens"] == 10]
    assert len(steps) == 2  # one call a step: both tenants' 2 prompts x 4 samples
    assert all([n.split("-")[0] for n in b["lora_path"]] == ["one"] * 8 + ["two"] * 8 for b in steps)
    for name in ("one", "two"):
        for r in metrics_rows(tmp_path / "run" / "tenants" / name):
            assert r["rollout/logprob_diff_max"] < 1e-4 and r["rollout/sync_check_diff_max"] < 1e-4
    sglang_server.core.lora["max_loaded_loras"] = 2  # each tenant's newest, and none to spare as the next loads
    with pytest.raises(
        ConfigError,
        match=r"cannot take adapters: it holds 2 adapters at once \(--max-loaded-loras\) "
        r"and the run serves 2 \(one per tenant\).*--max-loaded-loras 3 or more",
    ):
        main_raising(["tenants", str(tmp_path / "run.yaml"), "trainer.run_dir=" + str(tmp_path / "again")])


def main_raising(argv):
    """A command's function itself: its errors raised, not printed."""
    import argparse

    from hybridrl_tenants.command import add_command

    parser = argparse.ArgumentParser()
    add_command(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


def test_a_call_naming_more_adapters_than_a_batch_mixes_goes_in_parts(
    tiny_model, tmp_path, sglang_server, make_engine, prompts
):
    """Three adapters' prompts to a server that mixes two a batch: the engine session sends the prompts of the
    first two, then the third's, each seeded as in the whole call, and gives the answers in the prompts' order."""
    from hybridrl.components import SamplingParams
    from hybridrl.config import RolloutConfig
    from hybridrl.session import EngineSession

    core = sglang_server.core
    core.lora = {"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["all"], "max_loras_per_batch": 2}
    engine = make_engine(base_url=sglang_server.url, weights_dir=str(tmp_path / "w"), per_request_seed=True)
    session = EngineSession(engine, RolloutConfig())
    session.adapters = True
    for seed, name in enumerate("abc"):
        session.adapter = name
        session.sync(seeded_adapter(tiny_model, seed, 1)[0], update=False)
    sampling = SamplingParams(n=1, max_tokens=4, temperature=1.0, ignore_eos=True, seed=5)
    names = ["c", "a", "b", "a"]
    sglang_server.requests.clear()
    out = session.generate([prompts[0]] * 4, sampling.model_copy(update={"adapters": names}))
    sent = [b for p, b in sglang_server.requests if p == "/generate"]
    assert [[n.split("-")[0] for n in b["lora_path"]] for b in sent] == [["c", "a", "a"], ["b"]]
    for i, name in enumerate(names):  # each row is what its adapter samples for its seed alone
        alone = session.generate([prompts[0]], sampling.model_copy(update={"seed": 5 + i, "adapters": [name]}))
        # the same tokens; logprobs to float32's rounding, as the fake's batch of three differs from one
        assert out.token_ids[i] == alone.token_ids[0] and out.logprobs[i] == pytest.approx(alone.logprobs[0], abs=1e-5)
