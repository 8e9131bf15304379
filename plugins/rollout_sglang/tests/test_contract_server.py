"""Server mode over real HTTP: contract tests against a fake SGLang server on 127.0.0.1.

The server (``sglang_server`` in conftest.py) implements the subset of SGLang's native API
the plugin uses, in SGLang's formats, backed by a real transformers model; it is a contract
test, not a substitute for SGLang. Every call here crosses a socket.
"""

import pytest
import torch
from hybridrl_http.client import ServiceError

from hybridrl.components import SamplingParams
from hybridrl.config_sections import LoraOptions
from hybridrl.models import load_causal_lm


def generate_calls(server):
    return [body for path, body in server.requests if path == "/generate"]


def test_batches_of_n_samples_with_the_trainers_logprobs(make_engine, sglang_server, prompts, tiny_model, logprob_gap):
    """Contract test: 3 prompts x 4 samples in calls of 5 requests, 2 in flight; logprobs match the trainer."""
    engine = make_engine(base_url=sglang_server.url, batch_size=5, concurrency=2)
    s = SamplingParams(n=4, temperature=0.9, top_k=30, max_tokens=10, seed=1)
    out = engine.generate(prompts, s)

    calls = generate_calls(sglang_server)
    assert [len(c["input_ids"]) for c in calls] == [5, 5, 2]
    sent = sorted((tuple(row) for c in calls for row in c["input_ids"]), key=[tuple(p) for p in prompts].index)
    assert sent == [tuple(p) for p in prompts for _ in range(4)]
    assert all(c["return_logprob"] is True and c["sampling_params"]["top_k"] == 30 for c in calls)
    assert len(out.token_ids) == 12
    for ids, lps, finish in zip(out.token_ids, out.logprobs, out.finish_reasons):
        assert len(ids) == len(lps) and finish == ("stop" if ids[-1] == 1 else "length")
    model = load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))
    assert logprob_gap(model, prompts, out, 4, 0.9) < 1e-4  # grouped in order: prompt i -> rows 4i..4i+3


def test_weight_update_from_disk_changes_the_outputs(
    make_engine, sglang_server, prompts, tiny_model, logprob_gap, tmp_path
):
    """Contract test: weights saved as a HF folder, loaded by /update_weights_from_disk."""
    engine = make_engine(base_url=sglang_server.url, weights_dir=str(tmp_path / "w"), update_bucket_mb=0.06)
    policy = load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))
    for step in range(2):
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(step)) * 0.5)
        engine.update_weights(policy.state_dict().items())
    loads = [body["model_path"] for path, body in sglang_server.requests if path == "/update_weights_from_disk"]
    assert loads == [str(tmp_path / "w" / "v000001"), str(tmp_path / "w" / "v000002")]
    kept = sorted(p.name for p in (tmp_path / "w").iterdir())
    assert kept == ["v000002"]  # the previous version is deleted once the server has the new one
    files = sorted(p.name for p in (tmp_path / "w" / "v000002").iterdir())
    assert "config.json" in files and "model.safetensors.index.json" in files and "model-00003.safetensors" in files
    assert not any(f.startswith("model.safetensors") and f.endswith(".safetensors") for f in files)

    out = engine.generate(prompts, SamplingParams(n=2, max_tokens=8))
    original = load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))
    assert logprob_gap(policy, prompts, out, 2, 1.0) < 1e-3
    assert logprob_gap(original, prompts, out, 2, 1.0) > 0.1


def test_a_rejected_weight_update_reports_the_servers_message(make_engine, sglang_server):
    """Contract test: SGLang answers 400 with success false and a message."""
    engine = make_engine(base_url=sglang_server.url)
    with pytest.raises(ServiceError, match="update_weights_from_disk.*HTTP 400.*unknown parameter 'model.bogus'"):
        engine.update_weights([("model.bogus", torch.zeros(3))])


def test_busy_server_is_retried(make_engine, sglang_server, prompts):
    """Contract test: 503 twice, then an answer; the rollout is complete."""
    engine = make_engine(base_url=sglang_server.url, retries=3)
    sglang_server.fail_next(2)
    out = engine.generate(prompts, SamplingParams(n=2, max_tokens=4))
    assert len(out.token_ids) == 6 and len(generate_calls(sglang_server)) == 3


def test_a_server_that_stays_busy_fails_with_the_component_and_url(make_engine, sglang_server, prompts):
    engine = make_engine(base_url=sglang_server.url, retries=1)
    sglang_server.fail_next(10)
    with pytest.raises(ServiceError) as e:
        engine.generate(prompts, SamplingParams(n=1, max_tokens=4))
    msg = str(e.value)
    assert f"sglang rollout engine (server {sglang_server.url})" in msg
    assert f"{sglang_server.url}/generate failed after 2 attempts (HTTP 503" in msg


def test_a_dead_server_is_a_clear_error_at_start(make_engine):
    """Real: nothing listens on the port."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once the socket closes
    with pytest.raises(ServiceError) as e:
        make_engine(base_url=f"http://127.0.0.1:{port}", retries=0, timeout=2)
    msg = str(e.value)
    assert f"127.0.0.1:{port}/get_model_info failed after 1 attempts" in msg
    assert "Is the server running" in msg and "python -m sglang.launch_server --model-path" in msg


def test_stop_strings_on_the_server_or_here_give_the_same_kind_of_response(
    make_engine, sglang_server, prompts, tiny_model
):
    """Contract test: with stop_in_engine the server stops; without, the plugin cuts the response."""
    from hybridrl.models import load_tokenizer

    tok = load_tokenizer(tiny_model)
    stops = list("aeiou 0123456789")
    for in_engine in (True, False):
        engine = make_engine(base_url=sglang_server.url, stop_in_engine=in_engine)
        out = engine.generate(prompts, SamplingParams(n=4, max_tokens=12, stop=stops))
        assert ("stop" in generate_calls(sglang_server)[-1]["sampling_params"]) is in_engine
        cut = 0
        for ids, finish in zip(out.token_ids, out.finish_reasons):
            if finish == "stop" and ids[-1] != 1:
                cut += 1
                assert any(s in tok.decode(ids) for s in stops)  # the last token completes one
            assert not any(s in tok.decode(ids[:-1]) for s in stops)
        assert cut > 0


def test_release_memory_on_sleep_follows_the_trainers_cycle(make_engine, sglang_server, prompts, tiny_model):
    """Contract test: release on sleep, resume weights for the update, resume the rest on wake."""
    engine = make_engine(base_url=sglang_server.url, release_memory_on_sleep=True)
    policy = load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))
    engine.generate(prompts, SamplingParams(n=1, max_tokens=3))
    engine.sleep()
    with pytest.raises(RuntimeError, match="released by sleep"):
        engine.generate(prompts, SamplingParams(n=1, max_tokens=3))
    engine.update_weights(policy.state_dict().items())
    engine.wake_up()
    assert len(engine.generate(prompts, SamplingParams(n=1, max_tokens=3)).token_ids) == 3
    memory = [(p, b) for p, b in sglang_server.requests if "memory" in p or "update_weights" in p]
    assert [(p, b if "memory" in p else None) for p, b in memory] == [
        ("/release_memory_occupation", {}),
        ("/resume_memory_occupation", {"tags": ["weights"]}),
        ("/update_weights_from_disk", None),
        ("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}),
    ]


def test_api_key_is_sent_as_a_bearer_token(make_engine, sglang_server):
    """Contract test: a server started with --api-key answers 401 to other tokens."""
    sglang_server.api_key = "s3cret"
    with pytest.raises(ServiceError, match="get_model_info answered HTTP 401"):
        make_engine(base_url=sglang_server.url, api_key="wrong")
    engine = make_engine(base_url=sglang_server.url, api_key="s3cret")
    assert len(engine.generate([[5, 6]], SamplingParams(n=1, max_tokens=2)).token_ids) == 1


def test_sampler_is_the_config_not_the_generation_config(make_engine, sglang_server, tiny_model):
    """Contract test: the server takes unset fields from generation_config.json; the plugin sets them all."""
    from hybridrl_testing import SAMPLING_GENERATION_CONFIG, sampler_check

    diff, distinct = sampler_check(make_engine(base_url=sglang_server.url), tiny_model)
    assert diff < 1e-4
    assert distinct > SAMPLING_GENERATION_CONFIG["top_k"]


def test_a_sync_lands_while_a_request_runs_and_it_goes_on_under_the_new_weights(
    make_engine, sglang_server, prompts, tiny_model, tmp_path
):
    """Contract test (in_flight, a server without a radix cache): a sync that comes while a response is
    half decoded retracts it (/pause_generation, mode retract), loads without a flush (SGLang's scheduler
    fails on one while the request waits: the server died so on an H100), and lets it go on
    (/continue_generation): none of its tokens is lost, those before the sync are the old weights'
    samples, those after the new ones'."""
    import threading

    from hybridrl.passes import response_logprobs

    sglang_server.radix_cache = False  # --disable-radix-cache
    engine = make_engine(base_url=sglang_server.url, weights_dir=str(tmp_path / "w"))
    assert engine.updates_in_flight()  # its setup asked /continue_generation: the server has it
    core, reached, steps = sglang_server.core, threading.Event(), []

    def hook(core):  # the sixth token is sampled: hold the request there until the sync paused it
        steps.append(1)
        if len(steps) == 6:
            reached.set()
            while not core.paused and core.weights_version == 0:  # (or paused, loaded and went on)
                core.cond.wait(0.01)

    core.step_hook = hook
    original = load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))
    policy = load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.5)
    result = {}
    sampling = SamplingParams(n=1, max_tokens=16, temperature=1.0, ignore_eos=True)

    def generate():
        try:
            result["out"] = engine.generate(prompts[:1], sampling)
        except Exception as e:  # noqa: BLE001 - the test names it
            result["error"] = e

    thread = threading.Thread(target=generate)
    thread.start()
    assert reached.wait(60)
    engine.update_weights(policy.state_dict().items())
    thread.join(60)
    assert "out" in result, result
    (ids,), (lps,) = result["out"].token_ids, result["out"].logprobs
    assert len(ids) == 16  # nothing aborted, no token thrown away
    flow = [c[0] for c in core.calls if c[0] in ("pause_generation", "update_weights_from_disk", "continue_generation")]
    assert flow == ["continue_generation"] + ["pause_generation", "update_weights_from_disk", "continue_generation"]
    update = [b for p, b in sglang_server.requests if p == "/update_weights_from_disk"][-1]
    assert update["weight_version"] == "1" and ("/pause_generation", {"mode": "retract"}) in sglang_server.requests
    assert update["flush_cache"] is False and ("retracted",) in core.calls
    sequence = torch.tensor([prompts[0] + ids])
    mask, got = torch.ones_like(sequence), torch.tensor(lps)
    with torch.no_grad():
        old = response_logprobs(original, sequence, mask, 16, 1.0)[0][0]
        new = response_logprobs(policy, sequence, mask, 16, 1.0)[0][0]
    assert (got[:6] - old[:6]).abs().max() < 1e-4 and (got[6:] - new[6:]).abs().max() < 1e-4
    assert (got[6:] - old[6:]).abs().max() > 0.1  # the tokens after the sync are the new weights'


def test_syncs_in_flight_need_a_server_that_pauses(make_engine, sglang_server, capsys):
    """Contract test: a server without /pause_generation (before SGLang 0.5): 'on' stops with the reason,
    'auto' syncs between generations and says why once; memory release and adapters keep syncs out of flight."""
    sglang_server.pauses = False
    with pytest.raises(ServiceError, match=r"in_flight is 'on', but .* has no /pause_generation"):
        make_engine(base_url=sglang_server.url, in_flight="on")
    assert not make_engine(base_url=sglang_server.url).updates_in_flight()
    assert "): weight syncs wait for the requests in flight" in capsys.readouterr().err
    make_engine(base_url=sglang_server.url, lora=LoraOptions(r=4))  # adapter syncs still land in flight
    assert "full-weight syncs (an adapter loads beside those in use) wait" in capsys.readouterr().err
    sglang_server.pauses = True  # and a radix cache, SGLang's default: its prompts' KV would outlive a sync
    with pytest.raises(ServiceError, match=r"keeps a radix cache, .* start it with --disable-radix-cache"):
        make_engine(base_url=sglang_server.url, in_flight="on")
    assert not make_engine(base_url=sglang_server.url).updates_in_flight()
    assert "--disable-radix-cache" in capsys.readouterr().err
    sglang_server.radix_cache = False
    assert make_engine(base_url=sglang_server.url).updates_in_flight()
    assert not make_engine(base_url=sglang_server.url, release_memory_on_sleep=True).updates_in_flight()
    assert not make_engine(base_url=sglang_server.url, in_flight="off").updates_in_flight()
