"""The agent gateway with OpenAI's own client, unmodified: token-exact episodes over several calls,
forks where the harness rewrites its history, tools, streaming, n, stop strings, and refusals."""

import json

import openai
import pytest
import torch
from hybridrl_agents.episodes import Episode, Turn
from hybridrl_agents.gateway import Gateway
from hybridrl_agents.harness import HarnessEnvironment
from hybridrl_http.chat import cut_at_stop

from hybridrl.agents import observation_ids
from hybridrl.batch import Batch
from hybridrl.builtin.environments import HermesParser
from hybridrl.components import SamplingParams
from hybridrl.config import AgentConfig, RolloutConfig
from hybridrl.models import end_token_ids, load_causal_lm
from hybridrl.passes import response_logprobs

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
    },
}


@pytest.fixture(scope="module")
def parts(tiny_model, tmp_path_factory, recorded_loop):
    rollout = RolloutConfig(n=2, max_tokens=12, temperature=0.7)
    agent = AgentConfig(environment="harness", max_turns=8)
    ctx, engine, loop = recorded_loop(tiny_model, tmp_path_factory.mktemp("run"), rollout, agent)
    return ctx.tokenizer, ctx, engine, loop


def make_env(ctx, loop, agent, **options):
    env = HarnessEnvironment(HarnessEnvironment.Options(callable="os:getcwd", **options), ctx)
    env.agent, env.parser = agent, HermesParser(None, None)
    loop.env = env
    return env


def render(tok, messages, tools=None):
    """The ids of ``messages`` as the chat template frames them, ready for the assistant's turn."""
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def sampling(n=2, seed=5):
    return SamplingParams(n=n, max_tokens=12, temperature=0.7, seed=seed)


def three_calls(task):
    """An agent loop around the openai client: three calls, each sending the whole history back."""
    client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    messages = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": task.prompt}]
    for turn in range(3):
        reply = client.chat.completions.create(model="any", messages=messages, tools=[ADD], logprobs=True)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio"}))
        messages.append({"role": "user", "content": f"and now {turn}?"})
    return message.content


def rebuild(tok, engine, t):
    """The trajectory as the engine's calls and the observations' own tokens make it."""
    ids, mask, history = [], [], []
    for prompts, out in engine.calls:
        for p, sampled in zip(prompts, out.token_ids):
            sampled = sampled[: len(t.ids) - len(ids)]  # a call the episode's token budget cut is cut here
            if sampled and p == t.prompt + ids and t.ids[len(ids) : len(ids) + len(sampled)] == sampled:
                ids, mask = ids + sampled, mask + [1] * len(sampled)
                history.append(len(ids))
                if len(ids) < len(t.ids):
                    user = [{"role": "user", "content": f"and now {len(history) - 1}?"}]
                    last = sampled[-1] if sampled[-1] in end_token_ids(tok.name_or_path, tok) else None
                    obs = observation_ids(tok, user, [ADD], last)
                    ids, mask = ids + obs, mask + [0] * len(obs)
                break
    return ids, mask


def test_an_openai_client_agent_trains_on_exactly_the_sampled_tokens(parts):
    tok, ctx, engine, loop = parts
    env = make_env(ctx, loop, three_calls, batch_wait_s=60)  # each engine call waits for every episode's call
    engine.calls.clear()
    rows = [{"question": "2 + 3"}, {"question": "4 + 4"}]
    chats = [[{"role": "user", "content": "What is 2 + 3?"}], [{"role": "user", "content": "What is 4 + 4?"}]]
    out, trajectories = loop.run([[0], [0]], rows, chats, sampling())
    assert len(trajectories) == 4
    assert {(t.info["engine_calls"], t.info["engine_call_rows"]) for t in trajectories} == {(3, 4)}  # a call a turn
    for t, ids, mask in zip(trajectories, out.token_ids, out.sampled_masks):
        assert t.info["calls"] == 3 and t.info["forks"] == 0 and not t.state["lost"] and t.info["untrained_tokens"] == 0
        assert (ids, mask) == rebuild(tok, engine, t)  # token for token, and which are sampled
        system = {"role": "system", "content": "You add numbers."}
        assert t.prompt == render(tok, [system, {"role": "user", "content": t.messages[1]["content"]}], [ADD])
        assert t.last_text == t.messages[-1]["content"]
    # the engine's logprobs equal the trainer's on every sampled token; observations are 0
    batch = Batch.from_rollout([t.prompt for t in trajectories], out, 1, tok.pad_token_id)
    policy = load_causal_lm(tok.name_or_path, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        lp, _ = response_logprobs(policy, batch.input_ids, batch.attention_mask, batch["responses"].shape[1], 0.7)
    sampled = batch["response_mask"].bool()
    holes = (batch["response_attention_mask"] - batch["response_mask"]).bool()
    assert holes.any() and (lp[sampled] - batch["rollout_logprobs"][sampled]).abs().max() < 1e-4
    assert (batch["rollout_logprobs"][holes] == 0).all()
    env.close()


def test_a_rewritten_history_forks_a_new_branch_and_both_branches_train(parts):
    tok, ctx, engine, loop = parts

    def summarising(task):
        client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
        first = [{"role": "user", "content": task.prompt}]
        reply = client.chat.completions.create(model="any", messages=first)
        # the harness cuts its history: the reply is summarised, not sent back as it was
        said = len(reply.choices[0].message.content)
        summary = [{"role": "user", "content": f"{task.prompt} (earlier you said {said} characters)"}]
        client.chat.completions.create(model="any", messages=summary)

    for seed, branches in enumerate(("all", "last")):
        make_env(ctx, loop, summarising, branches=branches)
        engine.calls.clear()
        out, (t,) = loop.run([[0]], [{"q": 1}], [[{"role": "user", "content": "Hi"}]], sampling(n=1, seed=seed))
        loop.env.close()
        assert t.info["forks"] == 1 and t.info["calls"] == 2
        # the episode's row is the second call's branch alone: its own rendered prompt, all sampled
        prompts, answer = engine.calls[-1][0], engine.calls[-1][1]
        assert t.prompt in prompts and t.ids == answer.token_ids[prompts.index(t.prompt)] and set(t.sampled) == {1}
        (first_prompt,), first = engine.calls[-2][0], engine.calls[-2][1]  # the first branch: its call and reply
        if branches == "last":  # sampled, not trained, counted
            assert t.branches == [] and t.info["untrained_tokens"] == len(first.token_ids[0]) > 0
            continue
        # trained too, as a row of its own: its prompt, its sampled ids and their logprobs
        assert t.info["untrained_tokens"] == 0 and t.info["trained_branches"] == 2
        (branch,) = t.branches
        assert branch["prompt"] == first_prompt == render(tok, [{"role": "user", "content": "Hi"}])
        assert branch["ids"] == first.token_ids[0] and branch["logprobs"] == first.logprobs[0]
        assert branch["sampled"] == [1] * len(first.token_ids[0]) and branch["finish"] == first.finish_reasons[0]
        kept = t
    # a resumed rollout takes the finished episode from the store: its branches too, sampling nothing
    make_env(ctx, loop, summarising)
    engine.calls.clear()
    _, (again,) = loop.run([[0]], [{"q": 1}], [[{"role": "user", "content": "Hi"}]], sampling(n=1, seed=0))
    loop.env.close()
    assert engine.calls == [] and again.branches == kept.branches and again.ids == kept.ids


def test_the_trained_branches_are_the_calls_no_later_call_continued(live):
    gateway, episode, client = live
    chat = [{"role": "user", "content": "Count: one two three"}]
    # call 0: three answers; call 1 continues the third; call 2 starts over (a fork)
    third = client.chat.completions.create(model="any", messages=chat, n=3).choices[2].message
    history = [*chat, {"role": "assistant", "content": third.content}, {"role": "user", "content": "more"}]
    client.chat.completions.create(model="any", messages=history)
    client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Start over"}])
    answers, continued, fork = episode.turns[:3], episode.turns[3], episode.turns[4]
    assert episode.forks == 1 and continued.parent is answers[2] and fork.parent is None
    assert episode.trained() == [fork, continued] and episode.trained(branches=False) == [fork]
    assert continued.path == [answers[2], continued] and continued.ids[: len(answers[2].ids)] == answers[2].ids
    # untrained: the two answers of call 0 nobody continued; with the last branch only, call 1's path too
    unused = sum(len(a.ids) for a in answers[:2])
    assert episode.untrained_tokens(episode.trained()) == unused
    assert episode.untrained_tokens([fork]) == unused + continued.sampled.count(1)


def test_a_reply_sent_back_trimmed_or_padded_continues_the_episode(parts):
    tok, ctx, engine, loop = parts

    def trimming(task):  # smolagents and others keep the model's text stripped in their memory
        client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
        messages = [{"role": "user", "content": task.prompt}]
        reply = client.chat.completions.create(model="any", messages=messages)
        said = " " + reply.choices[0].message.content.strip() + "\n\n"  # never what was sampled
        messages += [{"role": "assistant", "content": said}, {"role": "user", "content": "and?"}]
        client.chat.completions.create(model="any", messages=messages)

    make_env(ctx, loop, trimming)
    engine.calls.clear()
    out, (t,) = loop.run([[0]], [{"q": "trimmed"}], [[{"role": "user", "content": "Hi"}]], sampling(n=1))
    assert t.info["calls"] == 2 and t.info["forks"] == 0 and t.info["untrained_tokens"] == 0
    first = engine.calls[0][1].token_ids[0]  # the trajectory keeps the ids sampled, not the harness's text
    assert t.ids[: len(first)] == first and t.sampled[: len(first)] == [1] * len(first)


def test_tool_calls_come_back_in_openais_shape_and_continue_the_episode(parts):
    tok, ctx, engine, loop = parts
    gateway = Gateway(loop, HermesParser(None, None), HarnessEnvironment.Options(callable="os:getcwd"), "tiny")
    try:
        episode = Episode("ep-tools", 0)
        text = 'Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
        message, finish = gateway._message(text, [ADD], "stop", episode)
        assert finish == "tool_calls" and message["content"] == "Let me add."
        (call,) = message["tool_calls"]
        assert call["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'} and call["id"].startswith("call_")
        # the harness sends the reply back with the tool's result: the episode continues, no fork
        chat = [{"role": "user", "content": "2 + 3?"}]
        ids = tok(text + "<|im_end|>", add_special_tokens=False)["input_ids"]
        prompt = render(tok, chat, [ADD])
        turn = Turn(chat, [ADD], message, prompt, ids, [-0.5] * len(ids), [1] * len(ids), 0, text, finish)
        gateway._record(episode, gateway_context(prompt), [turn])
        sent = [*chat, {**message, "tool_calls": [call]}, {"role": "tool", "tool_call_id": call["id"], "content": "5"}]
        from hybridrl_http.chat import messages

        ctx_ = episode.context(messages(sent), [ADD], tok, loop.end_ids)
        obs = observation_ids(tok, [{"role": "tool", "tool_call_id": call["id"], "content": "5"}], [ADD], ids[-1])
        assert not ctx_.forked and ctx_.ids == ids + obs and ctx_.sampled == [1] * len(ids) + [0] * len(obs)
        # a malformed call is left as text, counted
        message, finish = gateway._message("<tool_call>{add}</tool_call>", [ADD], "stop", episode)
        assert "tool_calls" not in message and finish == "stop" and episode.malformed == 1
    finally:
        gateway.close()


def gateway_context(prompt):
    from hybridrl_agents.episodes import Context

    return Context(prompt)


@pytest.fixture
def live(parts):
    """A gateway with one open episode, and a client on it."""
    tok, ctx, engine, loop = parts
    gateway = Gateway(loop, HermesParser(None, None), HarnessEnvironment.Options(callable="os:getcwd"), "tiny")
    episode = gateway.open(0, {}, sampling())
    client = openai.OpenAI(base_url=gateway.base_url(episode), api_key=gateway.token, max_retries=0)
    yield gateway, episode, client
    gateway.close()


def test_stream_n_stop_and_logprobs(live):
    gateway, episode, client = live
    chat = [{"role": "user", "content": "Count: one two three"}]
    reply = client.chat.completions.create(model="any", messages=chat, n=3, logprobs=True)
    assert len(reply.choices) == 3 and len(episode.turns) == 3
    for choice, turn in zip(reply.choices, episode.turns):
        assert [t.logprob for t in choice.logprobs.content] == pytest.approx(turn.logprobs)
    # a later call may continue any of the choices: the third one here, no fork
    third = reply.choices[2].message
    history = [*chat, {"role": "assistant", "content": third.content}, {"role": "user", "content": "more"}]
    client.chat.completions.create(model="any", messages=history)
    assert episode.forks == 0 and episode.final.ids[: len(episode.turns[2].ids)] == episode.turns[2].ids
    # streamed: the same reply as chunks
    chunks = list(client.chat.completions.create(model="any", messages=chat, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == episode.final.text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_a_stop_string_ends_the_text_before_it_and_the_tokens_at_the_one_that_completed_it(parts):
    tok = parts[0]
    ids = tok("The answer is 42. Done", add_special_tokens=False)["input_ids"]
    answer = {"ids": ids, "logprobs": [-1.0] * len(ids), "finish_reason": "length"}
    cut, text = cut_at_stop(answer, ["42.", "Done"], lambda i: tok.decode(i, skip_special_tokens=True))
    assert text == "The answer is " and cut["finish_reason"] == "stop"
    k = len(cut["ids"])
    assert "42." in tok.decode(ids[:k]) and "42." not in tok.decode(ids[: k - 1]) and cut["logprobs"] == [-1.0] * k
    assert cut_at_stop(answer, ["nowhere"], tok.decode) == (answer, tok.decode(ids))


def test_what_the_gateway_cannot_honour_is_refused_by_name(live, parts):
    gateway, episode, client = live
    chat = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="'seed': each answer is seeded by the server"):
        client.chat.completions.create(model="any", messages=chat, seed=3)
    with pytest.raises(openai.BadRequestError, match="'bar', 'baz': not a key hybridrl answers"):
        client.chat.completions.create(model="any", messages=chat, extra_body={"bar": 1, "baz": 2})
    with pytest.raises(openai.BadRequestError, match="rollout.temperature=0.7"):
        client.chat.completions.create(model="any", messages=chat, temperature=0.2)
    with pytest.raises(openai.BadRequestError, match="'tool_choice' must be auto, none, required"):
        client.chat.completions.create(model="any", messages=chat, tools=[ADD], tool_choice="any")
    # a call asked for is answered as the policy samples it: never forced, counted when not made
    client.chat.completions.create(model="any", messages=chat, tools=[ADD], tool_choice="required")
    assert episode.unforced == 1 and episode.calls == 1
    with pytest.raises(openai.BadRequestError, match="content must be a string or a list of text parts"):
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    other = openai.OpenAI(base_url=f"{gateway.url}/episodes/ep-none/v1", api_key=gateway.token, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="unknown episode 'ep-none'"):
        other.chat.completions.create(model="any", messages=chat)
    wrong = openai.OpenAI(base_url=gateway.base_url(episode), api_key="not-the-token", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="any", messages=chat)
    assert [m.id for m in client.models.list()] == ["tiny"]
    # the header form reaches the same episode
    by_header = openai.OpenAI(
        base_url=f"{gateway.url}/v1", api_key=gateway.token, default_headers={"X-Episode-Id": episode.id}
    )
    by_header.completions.create(model="any", prompt="1, 2, 3,", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="token ids outside the vocabulary"):
        by_header.completions.create(model="any", prompt=[5, 10**6], max_tokens=4)
    assert episode.calls == 2
    gateway.finish(episode)
    with pytest.raises(openai.ConflictError, match="has ended"):  # an ended episode takes no more calls
        client.chat.completions.create(model="any", messages=chat)
    gateway.forget(episode)  # in the store: the gateway knows it no more
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="any", messages=chat)


def test_a_posted_reward_is_kept_once(live):
    gateway, episode, client = live
    import urllib.request

    def post(value, episode_id=episode.id):
        request = urllib.request.Request(
            f"{gateway.url}/episodes/{episode_id}/reward",
            data=json.dumps({"reward": value}).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {gateway.token}"},
        )
        try:
            with urllib.request.urlopen(request) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    assert post("high")[0] == 400 and post(10**400)[0] == 400
    assert post(0.5) == (200, {"id": episode.id, "reward": 0.5, "stored": True})
    assert post(1.0)[0] == 409 and episode.reward == 0.5
    assert post(1.0, "ep-other")[0] == 404
