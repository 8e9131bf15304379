"""hybridrl's Tinker server against the real ``tinker`` SDK, unmodified, on the embedded SmolLM2-135M:
the SDK's quickstart calls (train, sample, score, save, load), several clients over one base, exact
resume after a SIGKILL of the server, and one clear error for each bad request."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("tinker")

import tinker  # noqa: E402
from hybridrl_tinker.futures import Worker  # noqa: E402
from tinker import types  # noqa: E402

from hybridrl.config import load_config  # noqa: E402

_spec = importlib.util.spec_from_file_location("tinker_tests_conftest", Path(__file__).with_name("conftest.py"))
conftest = sys.modules.setdefault(_spec.name, importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(conftest)
TOKEN, ALIAS = conftest.TOKEN, conftest.ALIAS
config = conftest.tinker_config
TEXT = "The quick brown fox jumps over the lazy dog, and the lazy dog sleeps in the sun. " * 2


@pytest.fixture
def server(tinker_server):
    return tinker_server.url, tinker_server.service


CLIENTS: list = []  # closed after each test, so that none heartbeats to a server that is gone


def client(url: str) -> tinker.ServiceClient:
    CLIENTS.append(tinker.ServiceClient(base_url=url, api_key=TOKEN))
    return CLIENTS[-1]


@pytest.fixture(autouse=True)
def close_clients():
    yield
    while CLIENTS:
        CLIENTS.pop().close("success").result(timeout=60)  # the server's /sessions/{id}/finish


def ready(made):
    """The client a creation call made (the SDK returns a future of it)."""
    return made.result() if hasattr(made, "_awaited_client") else made


def supervised(tokenizer, text: str = TEXT) -> types.Datum:
    ids = tokenizer(text)["input_ids"]
    inputs = {"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)}
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=inputs)


def step(training, data, lr: float = 1e-3) -> float:
    fb = training.forward_backward(data, "cross_entropy")
    training.optim_step(types.AdamParams(learning_rate=lr)).result()
    return fb.result().metrics["loss:sum"]


def test_the_sdks_quickstart_trains_samples_and_scores_with_the_same_weights(server):
    url, service = server
    training = ready(client(url).create_lora_training_client(base_model="smollm2", rank=8))
    info = training.get_info()
    assert info.model_data.model_name == "smollm2" and info.lora_rank == 8 and info.is_lora
    tokenizer = training.get_tokenizer()  # the local folder get_info names
    datum = supervised(tokenizer)
    first = training.forward_backward([datum], "cross_entropy").result()
    assert len(first.loss_fn_outputs[0]["logprobs"].tolist()) == len(datum.model_input.to_ints())
    losses = [step(training, [datum]) for _ in range(4)]
    assert losses[0] == pytest.approx(first.metrics["loss:sum"], rel=1e-5)  # nothing trained until optim_step
    assert losses[-1] < 0.7 * losses[0]  # it learns the text

    sampler = ready(training.save_weights_and_get_sampling_client())
    prompt = tokenizer("The quick brown")["input_ids"]
    result = sampler.sample(
        prompt=types.ModelInput.from_ints(prompt), sampling_params=types.SamplingParams(max_tokens=6), num_samples=3
    ).result()
    assert len(result.sequences) == 3
    for seq in result.sequences:
        assert 1 <= len(seq.tokens) == len(seq.logprobs) <= 6 and seq.stop_reason in ("stop", "length")
        # the engine sampled with the trained adapter: the trainer scores its tokens the same
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + seq.tokens)).result()
        assert scored[len(prompt) :] == pytest.approx(seq.logprobs, abs=1e-4)
    assert scored[0] is None


def test_clients_train_apart_over_one_base_and_the_base_stays(server):
    url, service = server
    sc = client(url)
    a = ready(sc.create_lora_training_client(base_model="smollm2", rank=8, seed=1))
    b = ready(sc.create_lora_training_client(base_model=ALIAS, rank=8, seed=2))  # the alias: the same local model
    tokenizer = a.get_tokenizer()
    datum = supervised(tokenizer)
    b_before = b.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    for _ in range(3):
        step(a, [datum])
    assert b.forward([datum], "cross_entropy").result().metrics["loss:sum"] == b_before  # untouched by a's steps
    base = ready(sc.create_sampling_client(base_model="smollm2"))
    ids = datum.model_input.to_ints() + [datum.loss_fn_inputs["target_tokens"].tolist()[-1]]
    base_lp = base.compute_logprobs(types.ModelInput.from_ints(ids)).result()
    assert -sum(base_lp[1:]) == pytest.approx(b_before, rel=1e-4)  # a fresh adapter is the base (lora_B zero)
    a_lp = ready(a.save_weights_and_get_sampling_client()).compute_logprobs(types.ModelInput.from_ints(ids)).result()
    assert -sum(a_lp[1:]) < 0.8 * -sum(base_lp[1:])


def test_named_weights_and_states_are_adapter_folders_that_load_back(server):
    url, service = server
    sc = client(url)
    training = ready(sc.create_lora_training_client(base_model="smollm2", rank=8))
    datum = supervised(training.get_tokenizer())
    step(training, [datum])
    state = training.save_state("first").result().path
    sampler_path = training.save_weights_for_sampler("first").result().path
    assert state.endswith("/weights/first") and sampler_path.endswith("/sampler_weights/first")
    folder = service.folder(state)
    assert {p.name for p in folder.iterdir()} == {
        "adapter_config.json", "adapter_model.safetensors", "optimizer.safetensors", "state.json",
    }  # fmt: skip
    with pytest.raises(tinker.RequestFailedError, match="exists"):
        training.save_state("first").result()
    resumed = ready(sc.create_training_client_from_state_with_optimizer(state))
    fresh_adam = ready(sc.create_training_client_from_state(state))
    same = [step(training, [datum]), step(training, [datum])]
    assert [step(resumed, [datum]), step(resumed, [datum])] == same  # AdamW's moments came back too
    assert [step(fresh_adam, [datum]), step(fresh_adam, [datum])][1] != same[1]
    ids = datum.model_input.to_ints() + datum.loss_fn_inputs["target_tokens"].tolist()[-1:]  # every target
    named = ready(sc.create_sampling_client(model_path=sampler_path)).compute_logprobs(types.ModelInput.from_ints(ids))
    assert -sum(named.result()[1:]) == pytest.approx(same[0], rel=1e-4)  # the weights saved after one step


def test_bad_requests_get_one_clear_line(server):
    url, service = server
    sc = client(url)
    with pytest.raises(tinker.BadRequestError, match="rank-8 adapters"):
        ready(sc.create_lora_training_client(base_model="smollm2", rank=32))
    with pytest.raises(tinker.BadRequestError, match=f"this server trains smollm2, {ALIAS}"):
        ready(sc.create_lora_training_client(base_model="meta-llama/Llama-3.1-8B", rank=8))
    training = ready(sc.create_lora_training_client(base_model="smollm2", rank=8))
    datum = supervised(training.get_tokenizer(), "Hello there, friend.")
    with pytest.raises(tinker.RequestFailedError, match="unknown loss 'focal'"):
        training.forward_backward([datum], "focal").result()
    with pytest.raises(tinker.RequestFailedError, match="loss 'stable_reinforce' is not served here: Tinker publishes"):
        training.forward_backward([datum], "stable_reinforce").result()
    ids = datum.model_input.to_ints()
    short = types.Datum(model_input=datum.model_input, loss_fn_inputs={"target_tokens": ids[:2], "weights": [1.0, 1.0]})
    with pytest.raises(tinker.RequestFailedError, match="one row per input token"):
        training.forward_backward([short], "cross_entropy").result()
    outside = types.Datum(model_input=types.ModelInput.from_ints([1, 10**6]), loss_fn_inputs={"target_tokens": [2, 3]})
    with pytest.raises(tinker.RequestFailedError, match="outside the vocabulary"):
        training.forward([outside], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="not a checkpoint path"):
        ready(sc.create_training_client_from_state("tinker://x/../../etc/weights/passwd"))
    status, reply = post(url, "save_weights_external", {"model_id": "x", "path": "w", "seq_id": 1})
    assert status == 404 and "does not serve external weights" in reply["error"]
    assert step(training, [datum]) > 0  # the client still trains after its refused calls


def post(url: str, path: str, body: dict, key: str | None = TOKEN):
    request = urllib.request.Request(f"{url}/api/v1/{path}", json.dumps(body).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    if key:
        request.add_header("X-API-Key", key)
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_key_is_checked(server):
    url, _ = server
    assert post(url, "create_session", {}, key=None)[0] == 401
    assert post(url, "create_session", {}, key="tml-wrong")[0] == 401
    status, reply = post(url, "create_session", {})
    assert status == 200 and reply["session_id"]


def test_a_models_calls_run_in_seq_order_whatever_order_they_arrive_in():
    done = []
    worker = Worker(sample=lambda futures: [])
    try:
        futures = [worker.submit_train("m", seq, lambda seq=seq: done.append(seq) or seq) for seq in (3, 1, 4, 2)]
        again = worker.submit_train("m", 3, lambda: done.append("again"))  # a retried submission: the same future
        assert again is futures[0]
        for f in futures:
            assert f.done.wait(10)
        assert done == [1, 2, 3, 4] and [f.result for f in futures] == [3, 1, 4, 2]
        assert worker.submit_train("m", 2, lambda: done.append("again")) is futures[3]  # never run twice
        assert done == [1, 2, 3, 4]
    finally:
        worker.stop()


def test_a_killed_server_resumes_each_client_exactly_from_its_saved_state(smollm2, tmp_path):
    path = tmp_path / "tinker.yaml"
    path.write_text(yaml.safe_dump(config(smollm2, tmp_path / "run")))

    def start() -> tuple[subprocess.Popen, str]:
        env = os.environ | {"HYBRIDRL_TINKER_TOKEN": TOKEN}
        cmd = [sys.executable, "-m", "hybridrl.cli", "tinker", str(path), "--port", "0"]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 300
        for line in proc.stdout:
            if "serving the Tinker API" in line:
                threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
                return proc, line.split(" on ")[1].split()[0]
            assert time.monotonic() < deadline, "the server did not start"
        raise AssertionError(f"the server exited ({proc.wait()})")

    proc, url = start()
    try:
        training = ready(client(url).create_lora_training_client(base_model="smollm2", rank=8))
        datum = supervised(training.get_tokenizer())
        step(training, [datum])
        state = training.save_state("after-1").result().path
        expected = [step(training, [datum]), step(training, [datum])]
        CLIENTS.pop().close("success").result(timeout=60)  # before the kill: nothing left to heartbeat to it
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    proc, url = start()
    try:
        resumed = ready(client(url).create_training_client_from_state_with_optimizer(state))
        assert [step(resumed, [datum]), step(resumed, [datum])] == expected
        CLIENTS.pop().close("success").result(timeout=60)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_a_config_without_lora_is_refused(smollm2, tmp_path):
    from hybridrl_tinker.command import check_config

    from hybridrl.errors import ConfigError

    data = config(smollm2, tmp_path / "run")
    del data["model"]["lora"]
    with pytest.raises(ConfigError, match="set model.lora"):
        check_config(load_config(data=data))


def test_top_k_targets_are_scored_per_candidate(server):
    """target_tokens of shape (N, K) (top-K distillation): each candidate scored at its position; two
    copies of the true next token at half weight each give the one-column loss, logprobs (N, K)."""
    url, _ = server
    training = ready(client(url).create_lora_training_client(base_model="smollm2", rank=8))
    one = supervised(training.get_tokenizer(), "Hello there, my good friend.")
    target = one.loss_fn_inputs["target_tokens"].to_torch()
    two = types.Datum(
        model_input=one.model_input,
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_torch(torch.stack([target, target], dim=1)),
            "weights": types.TensorData.from_torch(torch.full((len(target), 2), 0.5)),
        },
    )
    out = training.forward([one, two], "cross_entropy").result()
    lp_one, lp_two = (o["logprobs"].to_torch() for o in out.loss_fn_outputs)
    assert lp_two.shape == (len(target), 2) and torch.equal(lp_two[:, 0], lp_one) and torch.equal(lp_two[:, 1], lp_one)
    assert out.metrics["loss:sum"] == pytest.approx(-2 * float(lp_one.sum()), rel=1e-6)  # the two datums' losses


@pytest.mark.parametrize("arch", ["gpt2", "qwen3_moe", "gemma2"])
def test_other_families_train_sample_and_resume_exactly(arch, tmp_path):
    """The same calls over other families' checkpoints (bf16, sampling settings, chat templates):
    GPT-2's Conv1D layers and tied output layer, a Qwen3 MoE, Gemma-2 (soft-capped logits). The
    engine samples with the client's adapter (merged for the hf engine on the CPU): its logprobs
    equal the trainer's; a state saved and loaded repeats the next loss exactly."""
    from hybridrl_testing.models import build_checkpoint
    from hybridrl_tinker.server import make_server
    from hybridrl_tinker.service import TinkerService

    from hybridrl.run import build_run

    model = build_checkpoint(tmp_path / arch, arch)
    cfg = load_config(data=config(model, tmp_path / "run") | {"tinker": {"model_names": []}})
    run = build_run(cfg, "tinker", data=False)
    service = TinkerService(run, cfg.section("tinker"), arch)
    http = make_server(service, "127.0.0.1", 0, TOKEN, cfg.section("tinker"))
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        sc = client(f"http://127.0.0.1:{http.server_address[1]}")
        training = ready(sc.create_lora_training_client(base_model=arch, rank=8))
        ids = [3, 9, 4, 12, 7, 5, 11, 6, 8, 10]
        datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})  # fmt: skip
        first = step(training, [datum], lr=1e-2)
        state = training.save_state("one").result().path
        sampler = ready(training.save_weights_and_get_sampling_client())
        prompt = ids[:4]
        params = types.SamplingParams(max_tokens=6, temperature=1.0)
        out = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=4, sampling_params=params).result()
        for seq in out.sequences:
            scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + seq.tokens)).result()
            assert scored[len(prompt) :] == pytest.approx(seq.logprobs, abs=1e-4), arch
        expected = step(training, [datum], lr=1e-2)
        assert expected < first  # it learns
        resumed = ready(sc.create_training_client_from_state_with_optimizer(state))
        assert step(resumed, [datum], lr=1e-2) == expected
    finally:
        while CLIENTS:
            CLIENTS.pop().close("success").result(timeout=60)
        http.shutdown()
        service.close()
        run.close()
