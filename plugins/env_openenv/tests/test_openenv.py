"""OpenEnv environments in process: a GRPO run on one, observations as prompts and messages, actions
from replies (text or JSON), an MCP environment's tools shown and called, and bad input named."""

import json
from pathlib import Path

import pytest

from hybridrl.builtin.environments import HermesParser
from hybridrl.config import ConfigError, load_config
from hybridrl.plugins import lookup

ENVS = Path(__file__).parent / "envs.py"


def run_config(model, run_dir, env):
    spec = f"{ENVS}:{env}"
    agent = {"environment": "openenv", "max_turns": 4, "max_total_tokens": 1024}
    return {
        "model": {"path": model},
        "data": {"source": "openenv", "env": spec, "size": 8},
        "rollout": {"n": 2, "max_tokens": 12, "agent": agent | {"env": spec}},
        "rewards": [{"function": "environment"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.01},
        "trainer": {"steps": 2, "prompts_per_step": 2, "lr": 1e-2, "run_dir": str(run_dir)},
        "logging": {"loggers": ["jsonl"]},
    }


def test_grpo_trains_on_an_openenv_environment_in_process(tiny_model, tmp_path):
    from hybridrl.run import build_run
    from hybridrl.trainer import Trainer

    run = build_run(load_config(data=run_config(tiny_model, tmp_path / "run", "WordEnv")))
    assert run.data[3] == {"seed": 3, "prompt": "Write a word with the letter 'o'. Round 1 of 2."}
    batch = run.rollout.generate(1)
    assert "Write a word with the letter" in batch["prompt_text"][0]  # the first observation is the prompt
    assert max(batch["turns"]) == 2  # max_turns is 4: the environment said done after its second round
    assert batch["trajectory"][0][1] == {"role": "user", "content": "Round 2: another one."}
    metrics = Trainer(run).train()
    assert 1 < metrics["agent/turns_mean"] <= 2 and metrics["agent/observation_tokens_mean"] > 0
    assert metrics["rollout/logprob_diff_max"] < 1e-4  # engine and trainer agree on every sampled token


def environment(tiny_model, tmp_path, env, **options):
    from hybridrl.components import RunContext

    cls = lookup("environment", "openenv")
    built = cls(cls.Options(env=f"{ENVS}:{env}", **options), RunContext(tiny_model, None, None, None, 0, tmp_path))
    built.parser = HermesParser(None, None)
    return built


def test_a_reply_is_the_action_as_text_or_json_and_a_bad_one_is_answered(tiny_model, tmp_path):
    env = environment(tiny_model, tmp_path, "GuessEnv")  # GuessAction(guess: int): the reply is JSON
    state = env.reset({"seed": 7}, [])
    target = state["env"].state.target
    wrong = env.step(state, json.dumps({"guess": target - 1}))
    assert wrong.messages == [{"role": "user", "content": f"{target - 1} is wrong: go higher."}]
    assert wrong.reward == 0.0 and not wrong.done
    bad = env.step(state, "fifty")
    assert bad.messages[0]["content"] == "Invalid action: the reply must be a JSON object of guess (JSONDecodeError)."
    assert bad.info == {"invalid_actions": 1} and bad.reward is None and not bad.done
    right = env.step(state, json.dumps({"guess": target}))
    assert right.reward == 1.0 and right.done and right.messages[0]["content"] == "Correct!"
    words = environment(tiny_model, tmp_path, "WordEnv")  # WordAction(message: str): the reply as it is
    state = words.reset({"seed": 1}, [])
    assert words.step(state, "eel").reward == pytest.approx(2 / 3)


def test_an_mcp_environments_tools_are_shown_and_called(tiny_model, tmp_path):
    env = environment(tiny_model, tmp_path, "GuessToolEnv")
    (schema,) = env.schemas
    assert schema["function"]["name"] == "guess" and "hidden number" in schema["function"]["description"]
    n = schema["function"]["parameters"]["properties"]["n"]
    assert n == {"description": "your integer guess", "type": "integer"}
    state = env.reset({"seed": 3}, [])
    target = state["env"].state.target

    def call(**arguments):
        return f'<tool_call>{{"name": "guess", "arguments": {json.dumps(arguments)}}}</tool_call>'

    low = env.step(state, call(n=target - 1))
    assert low.messages == [{"role": "tool", "name": "guess", "content": "higher"}]
    assert low.reward == 0.0 and not low.done and low.info == {"tool_calls": 1, "tool_errors": 0}
    broken = env.step(state, call(n="abc") + '<tool_call>{"name": "guess", "arguments": {</tool_call>')
    assert broken.messages[0]["content"].startswith("error (") and broken.messages[1]["content"].startswith("error:")
    assert broken.info == {"tool_calls": 2, "tool_errors": 2}
    right = env.step(state, call(n=target))
    assert right.messages[0]["content"] == "correct" and right.reward == 1.0 and right.done
    state = env.reset({"seed": 3}, [])
    assert env.step(state, "I give up.").done  # no call: the reply is the answer


def test_a_wrong_environment_is_named_with_what_there_is(tiny_model, tmp_path):
    why = r"env '.*envs.py:WordAction' is not an OpenEnv Environment class; its module has: GuessEnv, GuessToolEnv, "
    why += "WordEnv"
    with pytest.raises(ConfigError, match=why):
        environment(tiny_model, tmp_path, "WordAction")
    with pytest.raises(ConfigError, match=r"cannot load env '.*envs.py:Nope': '.*envs.py' has no 'Nope'"):
        environment(tiny_model, tmp_path, "Nope")
    with pytest.raises(ConfigError, match="action_field 'text' is not a field of WordAction: message$"):
        environment(tiny_model, tmp_path, "WordEnv", action_field="text")
