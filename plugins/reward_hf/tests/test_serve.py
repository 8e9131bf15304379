"""serve-reward and the remote reward: real HTTP servers on 127.0.0.1, real models."""

import contextlib
import json
import math
import os
import queue
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
import yaml
from hybridrl_http.client import ServiceError, get_json, post_json
from hybridrl_http.commands import choose_token
from hybridrl_http.server import ALLOWED_HOSTS_ENV
from hybridrl_reward_hf.serve import TOKEN_ENV, RewardSet, build_context, make_server
from hybridrl_testing import raw_request as send

from hybridrl.cli import main
from hybridrl.config import load_config
from hybridrl.shaping import ShapingOptions

PROMPTS = ["What is the capital of France?", "Name a colour.", "What is 2 + 2?", "Say hi.", "Count to three."]
RESPONSES = ["Paris is the capital.", "Blue.", "It is 4", "hi 7", "one two three"]
ANSWERS = ["Paris", "blue", "4", "hello", "1 2 3"]


def run_config(model, rewards):
    return {
        "model": {"path": model},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 8},
        "rewards": rewards,
        "trainer": {"device": "cpu"},
    }


def model_rewards(xlmr, minilm):
    return [
        {"function": "reranker", "model": xlmr, "name": "relevance", "weight": 0.5, "activation": "none"},
        {"function": "embedding_similarity", "model": minilm, "name": "similarity", "weight": 2.0},
        {"function": "format", "pattern": "\\d", "weight": 1.0},
    ]


def batch_of(make_batch):
    messages = [[{"role": "user", "content": p}] for p in PROMPTS]
    return make_batch(PROMPTS, RESPONSES, answers=ANSWERS, messages=messages)


@contextlib.contextmanager
def serving(cfg_data, token=None, shaping=None):
    """A RewardSet served by make_server on 127.0.0.1 in a thread; yields (url, reward set)."""
    cfg = load_config(data=cfg_data)
    if shaping is not None:  # RewardConfig.shaping, as the core sets it
        cfg.rewards[0].shaping = ShapingOptions(**shaping)
    rewards = RewardSet(cfg, build_context(cfg))
    server = make_server(rewards, "127.0.0.1", 0, token)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", rewards
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def start_cli_server(cfg_path, *args):
    """``hybridrl serve-reward`` in a subprocess; returns (process, url, the token it printed, or
    '<token>' for one given) once it listens."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridrl.cli", "serve-reward", str(cfg_path), "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    try:
        line = lines.get(timeout=240) + lines.get(timeout=10)
    except queue.Empty:
        line = ""
    found = re.search(r"on (http://127\.0\.0\.1:\d+) ", line)
    token = re.search(r"'Authorization: Bearer ([^']+)'", line)
    if not (found and token):
        proc.kill()
        raise AssertionError(f"serve-reward did not start: {line!r} {proc.stderr.read()[-2000:]}")
    return proc, found.group(1), token.group(1)


def test_remote_round_trip_through_serve_reward_equals_local(
    tiny_model, xlmr_reranker, minilm, tmp_path, make_reward, make_batch
):
    rewards = model_rewards(xlmr_reranker, minilm)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(run_config(tiny_model, rewards)))
    batch = batch_of(make_batch)
    local = {
        "relevance": make_reward("reranker", model=xlmr_reranker, activation="none").score(batch),
        "similarity": make_reward("embedding_similarity", model=minilm).score(batch),
        "format": torch.tensor(make_reward("format", pattern="\\d").score(batch)),
    }
    combined = 0.5 * local["relevance"] + 2.0 * local["similarity"] + 1.0 * local["format"]
    proc, url, shown = start_cli_server(path, "--token", "s3cret")
    assert shown == "<token>"  # a token the user chose is not printed
    try:
        remote = make_reward("remote", url=url, token="s3cret", batch_size=2)
        torch.testing.assert_close(torch.tensor(remote.score(batch)), combined, atol=1e-5, rtol=1e-5)
        for name, expected in local.items():
            one = make_reward("remote", url=url, token="s3cret", reward=name).score(batch)
            torch.testing.assert_close(torch.tensor(one), expected.float(), atol=1e-5, rtol=1e-5)
        health = get_json(f"{url}/health", component="test", token="s3cret")
        assert [r["name"] for r in health["rewards"]] == ["relevance", "similarity", "format"]
        assert get_json(f"{url}/health", component="test") == {"status": "ok"}  # liveness alone
        # the token is enforced
        with pytest.raises(ServiceError, match="HTTP 401: .*missing or wrong token"):
            make_reward("remote", url=url).score(batch)
        with pytest.raises(ServiceError, match="HTTP 401"):
            make_reward("remote", url=url, token="wrong").score(batch)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_binding_beyond_localhost_needs_a_token(tiny_model, tmp_path, capsys):
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(run_config(tiny_model, [{"function": "format", "pattern": "7"}])))
    assert main(["serve-reward", str(path), "--host", "0.0.0.0", "--port", "0", "--no-token"]) == 2
    err = capsys.readouterr().err
    assert "--host 0.0.0.0 accepts connections from other machines, and no token is set" in err
    assert "Pass --token" in err and "leave out --no-token" in err


def test_the_command_makes_a_token_and_health_says_ok_alone_without_it(tiny_model, tmp_path, monkeypatch, capsys):
    """Any user of this machine reaches 127.0.0.1: the command requires a token unless told
    --no-token, and /health tells one without the token that it is alive, nothing of the setup."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(run_config(tiny_model, [{"function": "format", "pattern": "7", "name": "sevens"}])))
    proc, url, token = start_cli_server(path)
    try:
        assert len(token) >= 40
        assert get_json(f"{url}/health", component="test") == {"status": "ok"}
        assert get_json(f"{url}/health", component="test", token=token)["rewards"][0]["name"] == "sevens"
        body = {"prompts": ["q"], "responses": ["7"]}
        with pytest.raises(ServiceError, match="HTTP 401: .*missing or wrong token"):
            post_json(f"{url}/score", body, component="test")
        with pytest.raises(ServiceError, match="HTTP 401"):  # a wrong token on /health is no liveness check
            get_json(f"{url}/health", component="test", token="wrong")
        assert post_json(f"{url}/score", body, component="test", token=token)["scores"] == [1.0]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    # the token off, on request: a warning says what every local user can then do
    assert choose_token("serve-reward", "127.0.0.1", None, TOKEN_ENV, True, "score") is None
    assert "--no-token: every user of this machine can score" in capsys.readouterr().err
    assert choose_token("serve-reward", "127.0.0.1", "a" * 40, TOKEN_ENV, False, "score") == "a" * 40


def test_wrong_tokens_are_throttled_and_never_lock_out_the_right_one(tiny_model):
    """Behind a proxy every client has the proxy's address: one client's wrong tokens get 401, then
    429 with Retry-After, while a client with the right token is served all along."""
    with serving(run_config(tiny_model, [{"function": "format", "pattern": "7"}]), token="s3cret") as (url, _):
        body = json.dumps({"prompts": ["q"], "responses": ["7"]}).encode()
        sized = {"Content-Type": "application/json", "Content-Length": str(len(body))}
        good = sized | {"Authorization": "Bearer s3cret"}
        replies = [send(url, "POST", "/score", body, sized | {"Authorization": f"Bearer {i}"}) for i in range(14)]
        assert [status for status, *_ in replies] == [401] * 10 + [429] * 4
        status, reply, headers = replies[-1]
        assert "too many wrong tokens" in reply["error"] and 0 < int(headers["Retry-After"]) <= 60
        for _ in range(3):
            assert send(url, "POST", "/score", body, good)[:2] == (200, {"scores": [1.0], "rewards": {"format": [1.0]}})
        assert send(url, "GET", "/health", headers={"Authorization": "Bearer s3cret"})[1]["rewards"]
        assert send(url, "GET", "/health")[:2] == (200, {"status": "ok"})  # no token sent: liveness, not counted
        assert send(url, "POST", "/score", body, sized)[0] == 429  # the guesser still waits


def test_batches_are_sent_in_chunks_concurrently(tiny_model, make_reward, make_batch):
    with serving(run_config(tiny_model, [{"function": "format", "pattern": "\\d"}])) as (url, rewards):
        sizes = []
        score = rewards.score
        rewards.score = lambda request: sizes.append(len(request["responses"])) or score(request)
        batch = batch_of(make_batch)
        out = make_reward("remote", url=url, batch_size=2, concurrency=2).score(batch)
        assert out == [0.0, 0.0, 1.0, 1.0, 0.0] and sorted(sizes) == [1, 2, 2]


def test_contract_errors_are_answered_with_the_reason(tiny_model, minilm, make_reward, make_batch):
    rewards = [{"function": "embedding_similarity", "model": minilm}]
    with serving(run_config(tiny_model, rewards)) as (url, _):
        with pytest.raises(ServiceError, match="HTTP 400: .*'prompts' must be a list of 2 entries"):
            post_json(f"{url}/score", {"prompts": ["a"], "responses": ["x", "y"]}, component="test")
        with pytest.raises(ServiceError, match="HTTP 400: .*'responses' must be a list of strings"):
            post_json(f"{url}/score", {"prompts": ["a"]}, component="test")
        with pytest.raises(ServiceError, match="HTTP 404: .*use POST /score"):
            post_json(f"{url}/scores", {}, component="test")
        # the reward rejects the input (no answers): 422, not retried, with the reward's own message
        with pytest.raises(ServiceError, match="HTTP 422: .*reward 'embedding_similarity'.*set data.answer_column"):
            make_reward("remote", url=url, retries=3, backoff=5).score(make_batch(["q"], ["r"]))


def test_shaping_is_applied_to_the_served_combination(tiny_model, make_batch):
    rewards = [{"function": "format", "pattern": "7", "weight": 2.0}]
    with serving(run_config(tiny_model, rewards), shaping={"normalize": "batch"}) as (url, _):
        out = post_json(f"{url}/score", {"prompts": ["q"] * 4, "responses": ["7", "x", "7", "y"]}, component="t")
    # raw [1, 0, 1, 0]: mean 0.5, unbiased var 1/3 -> +-0.5 / sqrt(1/3) = +-0.866025, weight 2
    assert out["rewards"] == {"format": [1.0, 0.0, 1.0, 0.0]}
    z = 0.5 / math.sqrt(1 / 3 + 1e-8)
    assert out["scores"] == pytest.approx([2 * z, -2 * z, 2 * z, -2 * z], abs=1e-5)


def test_length_penalty_uses_sent_lengths_or_the_policy_tokenizer(tiny_model):
    rewards = [{"function": "format", "pattern": "7"}]
    with serving(run_config(tiny_model, rewards), shaping={"length_penalty": 0.1}) as (url, _):
        body = {"prompts": ["q", "q"], "responses": ["7", "777"]}
        # the tiny policy's tokenizer has one token per character: lengths 1 and 3
        assert post_json(f"{url}/score", body, component="t")["scores"] == pytest.approx([0.9, 0.7])
        sent = post_json(f"{url}/score", body | {"response_lengths": [10, 0]}, component="t")["scores"]
        assert sent == pytest.approx([0.0, 1.0], abs=1e-6)


def test_remote_fails_early_and_clearly(tiny_model, make_reward, monkeypatch):
    with pytest.raises(ServiceError, match=r"failed after 1 attempts.*Start the service first"):
        make_reward("remote", url="http://127.0.0.1:9", retries=0, timeout=2)
    monkeypatch.delenv("MY_REWARD_TOKEN", raising=False)
    with pytest.raises(ValueError, match="token_env is 'MY_REWARD_TOKEN', but it is not set"):
        make_reward("remote", url="http://127.0.0.1:9", token_env="MY_REWARD_TOKEN")
    with serving(run_config(tiny_model, [{"function": "format", "pattern": "7"}])) as (url, _):
        with pytest.raises(ValueError, match="reward is 'nope', but the service serves format"):
            make_reward("remote", url=url, reward="nope")


# -- what the server checks, and what the client accepts ---------------------------------------


def test_the_token_and_the_host_are_checked_before_the_body_is_read(tiny_model, monkeypatch, capfd):
    monkeypatch.delenv(ALLOWED_HOSTS_ENV, raising=False)
    with serving(run_config(tiny_model, [{"function": "format", "pattern": "7"}]), token="s3cret") as (url, rewards):
        port = url.rsplit(":", 1)[1]
        huge = {"Content-Type": "application/json", "Content-Length": str(60 * 2**20)}  # announced, never sent
        status, reply, _ = send(url, "POST", "/score", None, huge)
        assert status == 401 and "Bearer" in reply["error"]
        good = {"Authorization": "Bearer s3cret"}
        assert send(url, "POST", "/score", None, huge | good | {"Content-Length": "-1"})[0] == 400
        status, reply, _ = send(url, "POST", "/score", None, huge | good | {"Content-Length": str(65 * 2**20)})
        assert status == 413 and "64 MiB" in reply["error"]
        status, reply, _ = send(url, "GET", "/health", headers={"Host": f"attacker.example:{port}"})
        assert status == 403 and "--allow-host" in reply["error"]
        body = json.dumps({"prompts": ["q"], "responses": ["7"]}).encode()
        sized = {"Content-Type": "application/json", "Content-Length": str(len(body))}
        assert send(url, "POST", "/score", body, sized | good)[1]["scores"] == [1.0]

        def broken(request):
            raise RuntimeError("reward model at /home/alice/rm failed")

        rewards.score = broken
        status, reply, _ = send(url, "POST", "/score", body, sized | good)
        assert status == 500 and "alice" not in json.dumps(reply) and reply["error_id"] in capfd.readouterr().err


class Scripted(BaseHTTPRequestHandler):
    """A reward service that answers /score with ``answer``, or redirects to ``redirect``."""

    answer: object = None
    redirect: str | None = None
    seen: list = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._reply({"status": "ok", "rewards": [{"name": "format"}]})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        Scripted.seen.append(self.headers.get("Authorization"))
        if Scripted.redirect:
            self.send_response(307)
            self.send_header("Location", Scripted.redirect)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self._reply(Scripted.answer)

    def _reply(self, answer):
        data = json.dumps(answer).encode()  # NaN and Infinity go out as JSON's non-standard literals
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def scripted():
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), Scripted) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    Scripted.seen, Scripted.redirect = [], None
    yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    for s in servers:
        s.shutdown()
        s.server_close()


def test_remote_refuses_bad_scores_and_redirects(scripted, make_reward, make_batch):
    url, elsewhere = scripted
    reward = make_reward("remote", url=url, token="s3cret", retries=0)
    batch = make_batch(["q", "q"], ["a", "b"])
    cases = [
        ({"scores": [1.0, float("nan")]}, r"scores\[1\] is 'nan', not a finite number"),
        ({"scores": [float("inf"), 1.0]}, r"scores\[0\] is 'inf'"),
        ({"scores": [True, 1.0]}, r"scores\[0\] is 'True'"),
        ({"scores": ["1", 1.0]}, r"scores\[0\] is '1'"),
        ({"scores": [1.0]}, "has 1 scores for 2 responses"),
        ({"rewards": {}}, "has no list 'scores'"),
        ([1.0, 2.0], "is not a JSON object"),
    ]
    for answer, message in cases:
        Scripted.answer = answer
        with pytest.raises(ServiceError, match=rf"reward function 'remote' \({url}\): .*{message}"):
            reward.score(batch)
    Scripted.answer = {"scores": [0.5, -1]}
    assert reward.score(batch) == [0.5, -1.0]
    Scripted.seen, Scripted.redirect = [], f"{elsewhere}/score"
    with pytest.raises(ServiceError, match=rf"answered HTTP 307, a redirect to {elsewhere}/score"):
        reward.score(batch)
    assert Scripted.seen == ["Bearer s3cret"]  # the first server only: the token went nowhere else
