"""The ``python`` reward: verl's and TRL's reward functions from a file, run in worker processes
with a time limit per response; what reaches them, what comes back, and what a failure costs."""

import json
import sys
import textwrap

import pytest
import torch
from hybridrl_testing import alive

from hybridrl import plugins
from hybridrl.batch import Batch
from hybridrl.config import RewardConfig, load_config
from hybridrl.errors import ConfigError, StageError
from hybridrl.rewards import Rewards

VERL_ROW = {
    "data_source": "openai/gsm8k",
    "prompt": [{"role": "user", "content": "What is 3 + 4?"}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "7"},
    "extra_info": {"split": "train", "index": 5, "answer": "3 + 4 = 7\n#### 7", "question": "What is 3 + 4?"},
}

REWARDS = """
import asyncio, json, os, time

print("top-level code runs in the workers")


def compute_score(data_source, solution_str, ground_truth, extra_info=None, log=None):
    if log:
        with open(log, "a") as f:
            f.write(json.dumps([data_source, solution_str, ground_truth, extra_info]) + "\\n")
    if solution_str.startswith("sleep"):
        time.sleep(60)
    if solution_str.startswith("exit"):
        os._exit(1)
    if solution_str.startswith("raise"):
        raise KeyError("no such thing")
    right = solution_str.strip().endswith(ground_truth)
    return {"score": float(right), "acc": right, "length": len(solution_str), "pred": solution_str[-1:]}


async def remote_judge(solution_str, ground_truth, **kwargs):
    await asyncio.sleep(0.01)
    return 0.5 if ground_truth in solution_str else -0.5


def needs_a_model(solution_str, model):
    return 0.0


def accuracy(completions, solution, **kwargs):
    return [None if s is None else float(c.strip() == s) for c, s in zip(completions, solution)]


def chat_accuracy(prompts, completions, answer):
    return [float(c[0]["content"].strip() == a) + 0.1 * len(p) for p, c, a in zip(prompts, completions, answer)]
"""


@pytest.fixture
def rewards_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(textwrap.dedent(REWARDS))
    return path


def python_reward(**options):
    cls = plugins.lookup("reward function", "python")
    return cls(cls.Options.model_validate({"workers": 2, **options}), ctx=None)


def verl_batch(responses, row=VERL_ROW):
    b = Batch()
    b["response_mask"] = torch.ones(len(responses), 4, dtype=torch.long)
    b["response_text"] = responses
    b["answer"] = [row["reward_model"]["ground_truth"]] * len(responses)
    b["row"] = [row] * len(responses)
    return b


def score(fn, batch, **reward):
    """The reward through the trainer's Rewards: its scores and the step's metrics."""
    rewards = Rewards([(RewardConfig(function="python", **reward), fn)], torch.device("cpu"))
    metrics = rewards.score(batch)
    return batch["reward/python"].tolist(), metrics


def test_verl_compute_score_sees_the_rows_nested_fields_and_its_extras_are_logged(rewards_file, tmp_path):
    log = tmp_path / "calls.jsonl"
    fn = python_reward(path=f"{rewards_file}:compute_score", kwargs={"log": str(log)})
    try:
        scores, metrics = score(fn, verl_batch(["so 7", "so 8", "it is 7"]))
    finally:
        fn.close()
    assert scores == [1.0, 0.0, 1.0]
    seen = sorted(json.loads(line) for line in log.read_text().splitlines())
    extra = {**VERL_ROW["extra_info"], "num_turns": 2, "rollout_reward_scores": {}}  # as verl adds them
    assert seen[0] == ["openai/gsm8k", "it is 7", "7", extra]
    # the dict's other numbers are logged (bools count), strings are not
    assert metrics["reward/python/acc"] == pytest.approx(2 / 3) and metrics["reward/python/length"] == 5.0
    assert metrics["reward/python/errors"] == 0.0 and "reward/python/pred" not in metrics


def test_an_async_function_and_only_the_keywords_it_names(rewards_file):
    fn = python_reward(path=str(rewards_file), function_name="remote_judge")
    try:
        assert score(fn, verl_batch(["7", "8"]))[0] == [0.5, -0.5]
    finally:
        fn.close()


@pytest.mark.parametrize("response", ["sleep please", "exit now"])
def test_a_hanging_or_crashing_call_scores_0_names_the_response_and_the_pool_recovers(rewards_file, response, capfd):
    fn = python_reward(path=str(rewards_file), timeout_s=1, max_error_rate=0.5)
    try:
        scores, metrics = score(fn, verl_batch(["7", response + " " + "x" * 200, "7", "8"]))
        assert scores == [1.0, 0.0, 1.0, 0.0] and metrics["reward/python/errors"] == 0.25
        err = capfd.readouterr().err
        why = "timed out after 1 s" if response.startswith("sleep") else "the worker process exited (exit code 1)"
        assert (
            f"1 of 4 responses failed and score 0: response 1 ('{response} {'x' * (99 - len(response))}'): {why}" in err
        )
        assert score(fn, verl_batch(["7", "7"]))[0] == [1.0, 1.0]  # a fresh worker took the dead one's place
    finally:
        fn.close()


DAEMON = """
import os, time


def compute_score(solution_str, ground_truth, pidfile):
    # a daemon: the child forks and exits, the grandchild leaves the session and lives on
    if os.fork() == 0:
        if os.fork() == 0:
            os.setsid()
            with open(pidfile + ".part", "w") as f:
                f.write(str(os.getpid()))
            os.rename(pidfile + ".part", pidfile)
            while True:
                time.sleep(1)
        os._exit(0)
    os.wait()
    while not os.path.exists(pidfile):
        time.sleep(0.01)
    if solution_str == "hang":
        time.sleep(60)
    if solution_str == "crash":
        os._exit(1)
    return 1.0
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a child subreaper is Linux's")
@pytest.mark.parametrize("then", ["hang", "crash", "return"])
def test_a_daemon_the_function_starts_ends_with_its_worker(tmp_path, then):
    """A call that starts a session-leaving grandchild, then times out, crashes its worker, or returns:
    the grandchild ends with the worker that is replaced, or at close()."""
    (tmp_path / "daemon.py").write_text(DAEMON)
    pidfile = tmp_path / "daemon.pid"
    fn = python_reward(
        path=str(tmp_path / "daemon.py"), workers=1, timeout_s=1, max_error_rate=1, kwargs={"pidfile": str(pidfile)}
    )
    try:
        scores, metrics = score(fn, verl_batch([then]))
        pid = int(pidfile.read_text())
        assert metrics["reward/python/errors"] == (0.0 if then == "return" else 1.0)
        # a daemon of a call that went well is the function's own until close(); one of a failed call is gone
        assert alive(pid) == (then == "return")
    finally:
        fn.close()
    assert not alive(pid)


def test_more_failures_than_max_error_rate_fail_the_step_naming_them(rewards_file):
    fn = python_reward(path=str(rewards_file), timeout_s=1, max_error_rate=0)
    try:
        with pytest.raises(
            StageError,
            match=r"1 of 2 responses failed, more than max_error_rate=0: response 0 "
            r"\('raise it'\): KeyError: 'no such thing' \(my_rewards.py:\d+\)",
        ):
            score(fn, verl_batch(["raise it", "7"]))
        assert score(fn, verl_batch(["7"]))[0] == [1.0]
    finally:
        fn.close()


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("nowhere.py", r"no file nowhere.py \(a relative path is looked up beside the config file"),
        ("{file}:score_it", r"my_rewards.py defines no function 'score_it'. Functions it has: accuracy, chat_acc"),
        (
            "{file}:needs_a_model",
            r"needs_a_model\) requires 'model', which the call does not give: it passes "
            r"data_source, solution_str, ground_truth, extra_info by keyword",
        ),
        ("{file}:accuracy", r"accuracy\) requires 'completions', which .*choose the other style \(style: verl or trl"),
    ],
)
def test_a_missing_file_function_or_wrong_signature_is_one_config_error(rewards_file, path, message):
    with pytest.raises(ConfigError, match=message):
        python_reward(path=path.format(file=rewards_file))


def test_an_import_error_names_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nraise RuntimeError('no GPU here')\n")
    with pytest.raises(ConfigError, match=r"importing .*bad.py failed: RuntimeError: no GPU here \(bad.py:2\)"):
        python_reward(path=str(bad))


def trl_batch(prompts, responses, **columns):
    b = Batch()
    b["response_mask"] = torch.ones(len(responses), 3, dtype=torch.long)
    b["responses"] = torch.tensor([[5, 6, 7]] * len(responses))
    b["response_text"] = responses
    b["answer"] = [None] * len(responses)
    b["row"] = [{"prompt": p, **{k: v[i] for k, v in columns.items()}} for i, p in enumerate(prompts)]
    return b


def test_trl_reward_function_gets_the_rows_columns_and_none_scores_0(rewards_file):
    fn = python_reward(path=f"{rewards_file}:accuracy", style="trl")
    try:
        batch = trl_batch(["1+1=", "2+2=", "3+3="], [" 2", "5", "6"], solution=["2", "4", None])
        scores, metrics = score(fn, batch)
    finally:
        fn.close()
    assert scores == [1.0, 0.0, 0.0]  # None: not applicable, adds 0 to the sum as TRL's nansum does
    assert metrics["reward/python/not_applicable"] == pytest.approx(1 / 3)
    assert metrics["reward/python/errors"] == 0.0


def test_trl_conversational_prompts_get_message_completions(rewards_file):
    fn = python_reward(path=f"{rewards_file}:chat_accuracy", style="trl")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}]
    try:
        assert score(fn, trl_batch([chat, chat], ["2", "3"], answer=["2", "2"]))[0] == pytest.approx([1.2, 0.2])
        with pytest.raises(
            ConfigError,
            match=r"requires answer, which the rows do not have \(their other fields: "
            r"solution\)",
        ):
            score(fn, trl_batch([chat], ["2"], solution=["2"]))
    finally:
        fn.close()


def test_path_is_found_beside_the_config_file(rewards_file, tmp_path, monkeypatch):
    config = tmp_path / "run.yaml"
    config.write_text(
        "model: {path: unused}\ndata: {source: reasoning_gym, task: chain_sum}\n"
        "rewards: [{function: python, path: my_rewards.py:remote_judge}]\n"
    )
    monkeypatch.chdir(tmp_path.parent)
    options = load_config(config).rewards[0].options
    assert (options.path, options.function_name) == (str(rewards_file), "remote_judge")
    both = {"function": "python", "path": "f.py:a", "function_name": "b"}
    with pytest.raises(ConfigError, match="path names function 'a' and function_name 'b'"):
        load_config(data={"model": {"path": "x"}, "data": {"source": "reasoning_gym", "task": "x"}, "rewards": [both]})


def test_a_reward_that_cannot_load_stops_the_run_before_any_model_loads(
    rewards_file, tiny_model, tmp_path, monkeypatch
):
    import hybridrl.run

    monkeypatch.setattr(hybridrl.run, "load_causal_lm", lambda *a, **k: pytest.fail("a model was loaded"))
    cfg = {
        "model": {"path": tiny_model},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 4},
        "rewards": [{"function": "python", "path": f"{rewards_file}:compute_scores"}],
        "trainer": {"run_dir": str(tmp_path / "run")},
    }
    with pytest.raises(ConfigError, match=r"my_rewards.py defines no function 'compute_scores'"):
        hybridrl.run.build_run(load_config(data=cfg))
