"""The harness environment: unmodified agents as commands and callables, a whole GRPO run through
them, posted rewards, lost episodes that never stop the run, and finished episodes a resume reuses."""

import json
import os
import socket
import sys
import textwrap
import threading
import time
from pathlib import Path

import openai
import pytest
import torch
from hybridrl_agents.harness import HarnessEnvironment
from hybridrl_testing import alive, metrics_rows

from hybridrl import plugins
from hybridrl.agents import AgentLoop
from hybridrl.builtin.environments import HermesParser
from hybridrl.components import RewardFunction, RolloutEngine, RunContext, SamplingParams
from hybridrl.config import AgentConfig, ConfigError, RolloutConfig, load_config
from hybridrl.errors import StageError
from hybridrl.models import end_token_ids, load_tokenizer
from hybridrl.session import EngineSession

AGENT = textwrap.dedent(
    """
    import json, os, sys, urllib.request
    import openai

    client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY: the episode's
    messages = [{"role": "user", "content": os.environ["HYBRIDRL_PROMPT"]}]
    for turn in range(2):
        reply = client.chat.completions.create(model="policy", messages=messages)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "Are you sure?"}]
    open("answer.txt", "w").write(reply.choices[0].message.content)
    request = urllib.request.Request(
        os.environ["HYBRIDRL_REWARD_URL"],
        data=json.dumps({"reward": len(reply.choices[0].message.content) % 3}).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]},
    )
    urllib.request.urlopen(request).read()
    print("done")
    """
)


def run_config(model, run_dir, agent):
    return {
        "model": {"path": model},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 16},
        "rollout": {"n": 2, "max_tokens": 8, "agent": agent},
        "rewards": [{"function": "posted"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.01},
        "trainer": {"steps": 2, "prompts_per_step": 2, "lr": 1e-2, "run_dir": str(run_dir)},
        "logging": {"loggers": ["jsonl"]},
    }


def test_grpo_trains_an_unmodified_command_agent_on_its_posted_rewards(tiny_model, tmp_path):
    from hybridrl.run import build_run
    from hybridrl.trainer import Trainer

    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    agent = {"environment": "harness", "command": f"{sys.executable} {script}", "timeout_s": 120}
    agent |= {"concurrency": 4, "max_total_tokens": 256}
    run = build_run(load_config(data=run_config(tiny_model, tmp_path / "run", agent)))
    metrics = Trainer(run).train()
    assert metrics["agent/calls_mean"] == 2 and metrics["agent/lost_mean"] == 0 and metrics["agent/forks_mean"] == 0
    assert metrics["agent/reward_posted_mean"] == 1 and metrics["agent/observation_tokens_mean"] > 0
    assert metrics["rollout/logprob_diff_max"] < 1e-4  # engine and trainer agree on every sampled token
    assert stored(tmp_path / "run") == 2 * 2 * 2  # every finished episode is in the store, committed


FORKING = textwrap.dedent(
    """
    import itertools

    import openai

    EPISODES = itertools.count()  # the episodes of a call, numbered as they post: 3 of 0-5 differ mod 3

    def solve(task):  # each call rewrites the history: the episode forks, and both branches train
        client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
        first = client.chat.completions.create(model="p", messages=[{"role": "user", "content": task.prompt}])
        said = first.choices[0].message.content
        retry = [{"role": "user", "content": f"{task.prompt} You said {len(said)} characters. Again?"}]
        text = client.chat.completions.create(model="p", messages=retry).choices[0].message.content
        client.post(task.reward_url, body={"reward": next(EPISODES) % 3}, cast_to=object)
        return text
    """
)


def test_grpo_trains_every_branch_of_a_forked_episode_with_its_episodes_advantage(tiny_model, tmp_path, monkeypatch):
    from hybridrl_algo_grpo.functional import group_advantages

    from hybridrl.run import build_run
    from hybridrl.trainer import Trainer

    (tmp_path / "forking.py").write_text(FORKING)
    agent = {"environment": "harness", "callable": f"{tmp_path / 'forking.py'}:solve", "max_total_tokens": 64}
    config = run_config(tiny_model, tmp_path / "run", agent)
    config["trainer"] |= {"steps": 1, "prompts_per_step": 2}
    config["rollout"]["n"] = 3
    trained, update = [], Trainer.update
    monkeypatch.setattr(Trainer, "update", lambda self, batch, step: trained.append(batch) or update(self, batch, step))
    metrics = Trainer(build_run(load_config(data=config))).train()
    assert metrics["agent/forks_mean"] == 1 and metrics["agent/trained_branches_mean"] == 2
    assert metrics["agent/untrained_tokens_mean"] == 0 and metrics["batch/trained_fraction"] == 1
    (batch,) = trained
    branch = batch["branch_row"]
    assert len(batch) == 12 and branch.tolist() == [False] * 6 + [True] * 6  # each episode's first call, after
    # a branch row: the first call's prompt (the task alone) and tokens; the episode's score and group
    main, earlier = torch.arange(6), torch.arange(6, 12)
    assert (batch["scores"][earlier] == batch["scores"][main]).all()
    assert (batch["group_ids"][earlier] == batch["group_ids"][main]).all()
    assert not torch.equal(batch["prompts"][main], batch["prompts"][earlier][:, -batch["prompts"].shape[1] :])
    # the advantages: the GRPO formula over the 6 episodes (3 a group), each branch with its episode's
    mask = batch["response_mask"]
    want = group_advantages(batch["scores"][main], mask[main], batch["group_ids"][main])
    assert batch["scores"][main].unique().numel() > 1  # the rewards differ: the advantages are not all 0
    torch.testing.assert_close(batch["advantages"][main], want)
    first = batch["advantages"][:, 0]
    torch.testing.assert_close(first[earlier], first[main])
    assert metrics["rollout/logprob_diff_max"] < 1e-4  # engine and trainer agree on every row, the branches' too


@pytest.fixture
def loop(tiny_model, tmp_path):
    tok = load_tokenizer(tiny_model)
    ctx = RunContext(tiny_model, tok, torch.device("cpu"), torch.float32, 0, tmp_path)
    hf = plugins.lookup("rollout engine", "hf")
    rollout = RolloutConfig(n=2, max_tokens=6)
    agent = AgentConfig(environment="harness")
    loop = AgentLoop(
        EngineSession(hf(hf.Options(), ctx), rollout), None, agent, rollout, tok, end_token_ids(tiny_model, tok)
    )
    yield ctx, loop
    if loop.env is not None:
        loop.env.close()


def harness(ctx, loop, agent=None, **options):
    env = HarnessEnvironment(HarnessEnvironment.Options(**{"callable": "os:getcwd"} | options), ctx)
    if agent is not None:
        env.agent = agent
    env.parser = HermesParser(None, None)
    loop.env = env
    return env


def run(loop, rows=1, n=2, seed=1, first=0, train=False):
    chats = [[{"role": "user", "content": f"task {i}"}] for i in range(first, first + rows)]
    rows_ = [{"i": i} for i in range(first, first + rows)]
    return loop.run([[0]] * rows, rows_, chats, SamplingParams(n=n, max_tokens=6, seed=seed), train)


def post(url, token, reward):
    """POST a reward as a grader would: the status and the reply's text."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        url, data=json.dumps({"reward": reward}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def one_call(task):
    client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    return client.chat.completions.create(model="x", messages=[{"role": "user", "content": task.prompt}]).id


def test_a_resumed_rollout_reuses_the_episodes_that_finished(loop, capsys):
    ctx, loop_ = loop
    calls = []

    def counting(task):
        calls.append(task.episode_id)
        return one_call(task)

    harness(ctx, loop_, counting)
    first = run(loop_, rows=2)[1]
    assert len(calls) == 4
    loop_.env.close()
    # a new process on the same run folder: the same tasks and seeds find their episodes
    harness(ctx, loop_, counting)
    again = run(loop_, rows=2)[1]
    assert len(calls) == 4  # no harness ran again
    assert [(t.prompt, t.ids, t.logprobs, t.sampled) for t in again] == [
        (t.prompt, t.ids, t.logprobs, t.sampled) for t in first
    ]
    run(loop_, rows=2, seed=2)  # another step: new episodes
    assert len(calls) == 8


def test_late_rewards_hold_a_group_until_they_are_in_and_a_resume_hands_out_the_same(loop, capsys):
    ctx, loop_ = loop
    places = {}  # task -> {its episodes' places: their reward URLs}
    urls = {}  # task -> its episodes' reward URLs, in their places' order

    def grader_later(task):  # rewards task 0 at once; the others' rewards are posted later, by the test
        places.setdefault(task.row["i"], {})[int(task.episode_id.split("-")[1])] = task.reward_url
        urls[task.row["i"]] = [u for _, u in sorted(places[task.row["i"]].items())]
        one_call(task)
        if task.row["i"] == 0:
            assert post(task.reward_url, task.api_key, 0.5)[0] == 200

    with socket.socket() as s:  # a fixed port: the reward URLs outlive the process
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = harness(ctx, loop_, grader_later, reward_deadline_s=600, port=port)
    _, first = run(loop_, rows=2, train=True)
    # only task 0's group has its rewards: the call gets it alone; task 1's waits in the store
    assert [t.row for t in first] == [{"i": 0}] * 2 and [t.state["reward"] for t in first] == [0.5, 0.5]
    assert first[0].info["held_groups"] == 1 and first[0].info["reward_posted"] == 1
    token = env.gateway.token
    assert [post(u, token, 1.0 + k)[0] for k, u in enumerate(urls[1])] == [200, 200]  # late: stored, committed
    status, why = post(urls[1][0], token, 3.0)
    assert status == 409 and "already has its reward" in why
    status, why = post(urls[0][0], token, 3.0)
    assert status == 409 and "already has its reward" in why
    _, second = run(loop_, rows=2, seed=2, first=2, train=True)  # tasks 2 and 3 get no reward yet
    assert [t.row for t in second] == [{"i": 1}] * 2 and [t.state["reward"] for t in second] == [1.0, 2.0]
    assert second[0].info["held_groups"] == 2
    status, why = post(urls[1][1], token, 3.0)
    assert status == 409
    episodes = [t.state["id"] for t in second]
    loop_.env.close()
    # a new process on the same run folder: the same call is answered with the same group, nothing runs again
    env = harness(ctx, loop_, grader_later, reward_deadline_s=600, port=port)
    calls = sum(len(u) for u in urls.values())
    _, again = run(loop_, rows=2, seed=2, first=2, train=True)
    assert [t.state["id"] for t in again] == episodes and sum(len(u) for u in urls.values()) == calls
    assert env.gateway.token == token  # the token is the run's: a grader posting hours later still gets in
    assert post(urls[2][0], token, 4.0)[0] == 200  # to the new gateway, for an episode of the old process
    loop_.env.close()
    # past the deadline a group trains without the rewards that did not come (the posted reward gives 0)
    harness(ctx, loop_, grader_later, reward_deadline_s=0.01)
    _, third = run(loop_, rows=1, seed=3, first=4, train=True)
    assert [t.row for t in third] == [{"i": 2}] * 2 and [t.state["reward"] for t in third] == [4.0, None]
    assert [t.info["reward_posted"] for t in third] == [1, 0]
    # evaluation is never answered with held groups, and holds none
    _, evaluated = run(loop_, rows=1, seed=4, first=9)
    assert [t.row for t in evaluated] == [None, None] and evaluated[0].messages[0]["content"] == "task 9"


def test_a_failing_hanging_or_silent_harness_loses_its_episode_not_the_run(loop, tmp_path, capsys):
    ctx, loop_ = loop

    def flaky(task):
        if task.episode_id.startswith("ep-0-"):
            raise RuntimeError("the agent broke")
        if task.episode_id.startswith("ep-1-"):
            return None  # made no call
        return one_call(task)

    harness(ctx, loop_, flaky)
    _, (broken, silent, fine, _) = run(loop_, rows=2)
    assert broken.state["lost"] == "the callable raised RuntimeError: the agent broke" and broken.ids == []
    assert silent.state["lost"] == "it made no call to the gateway" and silent.info["lost"] == 1
    assert fine.state["lost"] is None and fine.ids and fine.info["lost"] == 0
    err = capsys.readouterr().err
    assert "agent harness: episode ep-0-" in err and "lost: the callable raised RuntimeError" in err
    # a command that hangs is stopped at timeout_s with what it started; one that fails is named
    marker = tmp_path / "child-alive"
    hang = tmp_path / "hang.py"
    child = tmp_path / "child.py"
    child.write_text(f"import time\ntime.sleep(4)\nopen({str(marker)!r}, 'w')\n")
    hang.write_text(
        f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, {str(child)!r}])\ntime.sleep(60)\n"
    )
    loop_.env.close()
    harness(ctx, loop_, callable=None, command=f"python {hang}", timeout_s=1)
    loop_.env.succeeded = True  # a run whose harness has worked before: its lost episodes are the policy's
    _, trajectories = run(loop_, rows=1, seed=7)
    assert all("longer than timeout_s=1 s" in t.state["lost"] for t in trajectories)
    time.sleep(4.5)
    assert not marker.exists()  # the harness's child was killed with it
    loop_.env.close()
    # a harness that never works stops the run at its first rollout, saying why
    harness(ctx, loop_, callable=None, command="python -c 'import sys; print(\"no model here\"); sys.exit(3)'")
    why = "every episode of the run's first rollout was lost; the first: the command exited with status 3: no model"
    with pytest.raises(StageError, match=why):
        run(loop_, rows=1, seed=8)


def test_a_flooding_agent_is_stopped_at_max_calls(loop):
    ctx, loop_ = loop
    seen = []

    def flood(task):
        client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
        try:
            while True:
                client.chat.completions.create(model="x", messages=[{"role": "user", "content": "again"}])
                seen.append(1)
        except openai.RateLimitError as e:
            return str(e)

    harness(ctx, loop_, flood, max_calls=3)
    _, trajectories = run(loop_, rows=1, n=1)
    assert len(seen) == 3 and trajectories[0].info["calls"] == 3 and not trajectories[0].state["lost"]


def test_harness_options_name_what_is_wrong(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="set one of 'command'.*or 'callable'"):
        load_config(data=run_config(tiny_model, tmp_path, {"environment": "harness"}))
    with pytest.raises(ConfigError, match="answer: returned needs callable"):
        load_config(
            data=run_config(tiny_model, tmp_path, {"environment": "harness", "command": "x", "answer": "returned"})
        )
    with pytest.raises(ConfigError, match=r"Did you mean 'timeout_s'"):
        load_config(data=run_config(tiny_model, tmp_path, {"environment": "harness", "command": "x", "timeout": 3}))


def test_the_gateway_is_gone_with_the_run(loop):
    ctx, loop_ = loop
    env = harness(ctx, loop_, one_call)
    run(loop_, rows=1, n=1)
    url = env.gateway.url
    env.close()
    loop_.env = None
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=2)
    with pytest.raises(openai.APIConnectionError):
        client.models.list()
    assert not any(os.path.exists(f) for f in env.folders)


KILLED_AGENT = textwrap.dedent(
    """
    import json, os, sys, time
    import openai

    log = os.environ["AGENT_LOG"]
    me = [os.environ["HYBRIDRL_EPISODE_ID"].split("-")[1], os.environ["HYBRIDRL_PROMPT"]]
    finished = sum('"done"' in line for line in open(log)) if os.path.exists(log) else 0
    with open(log, "a") as f:
        f.write(json.dumps(["start", *me]) + "\\n")
    if finished >= 4:  # the second step: the first agent to get here hangs until the trainer is killed
        try:
            fd = os.open(os.environ["AGENT_LOG"] + ".hung", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            time.sleep(600)
        except FileExistsError:
            pass
    client = openai.OpenAI(max_retries=0)
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": me[1]}])
    with open(log, "a") as f:
        f.write(json.dumps(["done", *me]) + "\\n")
    """
)


def stored(run_dir) -> int:
    """Episodes committed to the run's store (0 before it exists)."""
    import sqlite3

    from hybridrl_agents.store import STORE

    if not (run_dir / STORE).exists():
        return 0
    db = sqlite3.connect(run_dir / STORE)
    try:
        return db.execute("SELECT COUNT(*) FROM episodes").fetchone()[0]
    except sqlite3.OperationalError:  # the table is not there yet
        return 0
    finally:
        db.close()


def test_after_a_sigkill_resume_runs_each_finished_episode_once(tiny_model, tmp_path):
    """The trainer is killed in the second step's rollout, with three of its four episodes finished
    (committed to the store) and one hanging; the resumed run reuses the three and runs only the
    fourth again."""
    import json
    import signal
    import subprocess

    import yaml

    script, log, run_dir = tmp_path / "agent.py", tmp_path / "agent.log", tmp_path / "run"
    script.write_text(KILLED_AGENT)
    agent = {"environment": "harness", "command": f"python {script}", "env": {"AGENT_LOG": str(log)}}
    cfg = run_config(tiny_model, run_dir, agent | {"concurrency": 4, "timeout_s": 300})
    cfg["rewards"] = [{"function": "format", "pattern": "7"}]
    cfg["trainer"] |= {"save_every": 1}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    command = [str(Path(sys.executable).with_name("hybridrl")), "train", str(tmp_path / "run.yaml")]
    errors = open(tmp_path / "trainer.err", "wb")
    trainer = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors, start_new_session=True)
    hung = log.with_name("agent.log.hung")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and trainer.poll() is None:  # until 3 of step 2's are committed
        if hung.exists() and stored(run_dir) == 4 + 3:
            break
        time.sleep(0.2)
    assert trainer.poll() is None, (tmp_path / "trainer.err").read_text()[-2000:]
    os.killpg(trainer.pid, signal.SIGKILL)  # the trainer and what runs in its session
    trainer.wait()
    errors.close()
    hanging = int(hung.read_text())  # in a session of its own, but it dies with the trainer
    deadline = time.monotonic() + 10
    while alive(hanging) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(hanging)
    assert (run_dir / "checkpoints").exists()  # the first step's
    resumed = subprocess.run([*command, "--resume"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    lines = [tuple(json.loads(line)) for line in log.read_text().splitlines()]
    done = [line[1:] for line in lines if line[0] == "done"]
    assert len(done) == len(set(done)) == 8  # every episode of both steps finished exactly once
    assert len([line for line in lines if line[0] == "start"]) == 9  # only the killed one ran twice
    metrics = metrics_rows(run_dir)
    assert [m["step"] for m in metrics if "agent/calls_mean" in m] == [1, 2]


class InFlight(RolloutEngine):
    """Contract stand-in of a server engine that takes syncs in flight (the vllm or sglang server with
    in_flight), which a streamed run needs: the real hf engine, calls from any thread one at a time."""

    weight_format = "transformers"

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        from hybridrl.builtin.rollout_hf import HFEngine

        self.hf, self.lock = HFEngine(HFEngine.Options(), ctx), threading.Lock()

    def runs_apart(self):
        return True

    def updates_in_flight(self):
        return True

    def generate(self, prompts, sampling):
        with self.lock:
            return self.hf.generate(prompts, sampling)

    def update_weights(self, named_tensors):
        with self.lock:
            self.hf.update_weights(named_tensors)

    def close(self):
        self.hf.close()


STREAMED = textwrap.dedent(
    """
    import threading

    import openai

    LOCK, COUNT = threading.Lock(), {"running": 0, "most": 0}  # episodes running at once, the most of them

    def solve(task):  # the answer, also written into the episode's working folder
        with LOCK:
            COUNT["running"] += 1
            COUNT["most"] = max(COUNT["most"], COUNT["running"])
        try:
            client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
            reply = client.chat.completions.create(model="p", messages=[{"role": "user", "content": task.prompt}])
            (task.workdir / "answer.txt").write_text(reply.choices[0].message.content)
        finally:
            with LOCK:
                COUNT["running"] -= 1
    """
)


class FromFolder(RewardFunction):
    """A reward that reads what the agent left in its working folder: the folder is there when it scores."""

    folders: list[str] = []  # those scored before
    prompts: list[str] = []
    lingering = 0  # folders scored before that were still there

    def score(self, batch):
        folders = [Path(state["workdir"]) for state in batch["episode"]]
        FromFolder.lingering += sum(Path(f).exists() for f in self.folders)
        self.folders.extend(map(str, folders))
        self.prompts.extend(batch["prompt_text"][::2])
        return [float((f / "answer.txt").read_text() == text) for f, text in zip(folders, batch["response_text"])]


def test_streamed_harness_groups_run_at_once_and_each_folder_lasts_until_its_rewards(
    tiny_model, tmp_path, register_plugin
):
    """rollout.stream with the harness: each group's episodes are a rollout call of their own, several at
    once through one gateway; a step trains the first groups to finish, each scored once with the files
    its agent left, whose folders go once scored."""
    from hybridrl.hookspecs import hookimpl
    from hybridrl.run import build_run
    from hybridrl.trainer import Trainer

    class Plugin:
        @hookimpl
        def register_rollout_engines(self, register):
            register("in_flight", InFlight)

        @hookimpl
        def register_reward_functions(self, register):
            register("from_folder", FromFolder)

    register_plugin(Plugin(), name="in-flight")
    FromFolder.folders, FromFolder.prompts, FromFolder.lingering = [], [], 0
    (tmp_path / "streamed.py").write_text(STREAMED)
    agent = {"environment": "harness", "callable": f"{tmp_path / 'streamed.py'}:solve", "max_total_tokens": 64}
    cfg = run_config(tiny_model, tmp_path / "run", agent)
    cfg["rollout"] |= {"engine": "in_flight", "async": 1, "stream": True}
    cfg["rewards"] = [{"function": "from_folder"}]
    cfg["trainer"]["steps"] = 3
    trainer = Trainer(build_run(load_config(data=cfg)))
    trainer.train()
    rows = metrics_rows(tmp_path / "run")
    assert [r["rollout/groups"] for r in rows] == [2, 2, 2] and all(r["agent/lost_mean"] == 0 for r in rows)
    assert all(r["reward/from_folder/mean"] == 1 for r in rows)  # every folder held its agent's answer
    assert len(FromFolder.prompts) == len(set(FromFolder.prompts)) == 6  # each group scored once
    assert trainer.run.agent.env.agent.__globals__["COUNT"]["most"] > 2  # more than one group's (n = 2) at once
    assert FromFolder.lingering == 0 and not any(Path(f).exists() for f in FromFolder.folders)  # each went once scored
    assert trainer.run.agent.env.gateway.pending == 0
