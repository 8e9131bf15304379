"""Multi-turn rollouts: token in, token out; masks; logprobs per turn; tools, parsers and the sandbox."""

import json
import os

import pytest
import torch
from hybridrl_reward_python.calculator import Calculator
from hybridrl_testing import SevensPlugin

from hybridrl import plugins
from hybridrl.agents import AgentLoop, Trajectory, observation_ids
from hybridrl.batch import Batch
from hybridrl.builtin.environments import HermesParser
from hybridrl.components import Environment, Observation, RunContext, SamplingParams
from hybridrl.config import AgentConfig, ConfigError, RolloutConfig, load_config
from hybridrl.errors import StageError
from hybridrl.hookspecs import hookimpl
from hybridrl.models import end_token_ids, load_causal_lm, load_tokenizer
from hybridrl.passes import response_logprobs
from hybridrl.session import EngineSession

# -- observations as the chat template frames them -------------------------------------------


def test_observation_tokens_are_the_templates_framing_rendered_once(tiny_model):
    tok = load_tokenizer(tiny_model)
    tool = [{"role": "tool", "name": "calculator", "content": "4"}]
    text = tok.decode(observation_ids(tok, tool, None, after=1))  # the turn ended with <|im_end|> (id 1)
    assert text == "\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    # a turn cut by a stop string did not sample the end of the turn: the observation brings it
    text = tok.decode(observation_ids(tok, [{"role": "user", "content": "again"}], None, after=None))
    assert text == "<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"


# -- token in, token out over several turns, with a real engine --------------------------------


class GoOn(Environment):
    """Answers every turn with a user message until the third turn."""

    def reset(self, row, messages):
        return {"turn": 0}

    def step(self, state, turn):
        state["turn"] += 1
        return Observation([{"role": "user", "content": f"go on {state['turn']}"}], done=state["turn"] >= 3)


class Recording:
    """The real hf engine, recording what each call was asked and answered."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, sampling):
        out = self.engine.generate(prompts, sampling)
        self.calls.append((prompts, out, sampling))
        return out

    def seeds_each_request(self):
        return False

    def updates_in_flight(self):
        return False


def agent_config(**kw):
    return AgentConfig(environment="go_on", max_turns=3, **kw)


def run_loop(tiny_model, tmp_path, max_total_tokens=None):
    tok = load_tokenizer(tiny_model)
    ctx = RunContext(tiny_model, tok, torch.device("cpu"), torch.float32, 0, tmp_path)
    hf = plugins.lookup("rollout engine", "hf")
    engine = Recording(hf(hf.Options(), ctx))
    rollout = RolloutConfig(n=4, max_tokens=24, stop=["e", "t", "a"], temperature=0.7)
    loop = AgentLoop(
        EngineSession(engine, rollout),
        GoOn(None, ctx),
        agent_config(max_total_tokens=max_total_tokens),
        rollout,
        tok,
        end_token_ids(tiny_model, tok),
    )
    prompts = [tok("What is 2 + 3?")["input_ids"], tok("Say seven")["input_ids"]]
    chats = [[{"role": "user", "content": "What is 2 + 3?"}], [{"role": "user", "content": "Say seven"}]]
    sampling = SamplingParams(n=4, max_tokens=24, stop=["e", "t", "a"], temperature=0.7, seed=3)
    out, trajectories = loop.run(prompts, [{}, {}], chats, sampling)
    return tok, engine, prompts, out, trajectories


def test_trained_tokens_are_the_sampled_tokens_and_the_observations(tiny_model, tmp_path):
    tok, engine, prompts, out, trajectories = run_loop(tiny_model, tmp_path)
    turns = [t.turns for t in trajectories]
    assert max(turns) == 3 and len(set(turns)) > 1  # different turn counts in one batch
    for t, ids, mask in zip(trajectories, out.token_ids, out.sampled_masks):
        # rebuild the response from what the engine returned and the observations' own tokens
        want, want_mask, turn = [], [], 0
        for call_prompts, call_out, _ in engine.calls:
            for p, sampled in zip(call_prompts, call_out.token_ids):
                sampled = sampled[: len(ids) - len(want)]  # a turn the trajectory's budget cut is cut here
                if p == prompts[t.index // 4] + want and ids[len(want) : len(want) + len(sampled)] == sampled:
                    want += sampled
                    want_mask += [1] * len(sampled)
                    turn += 1
                    if len(want) < len(ids):  # an observation followed
                        obs = observation_ids(tok, [{"role": "user", "content": f"go on {turn}"}], None, want[-1])
                        want += obs
                        want_mask += [0] * len(obs)
                    break
        assert ids == want and mask == want_mask, t.index
        assert turn == t.turns


def test_engine_logprobs_equal_the_trainers_on_every_sampled_token(tiny_model, tmp_path):
    tok, _, prompts, out, _ = run_loop(tiny_model, tmp_path)
    batch = Batch.from_rollout(prompts, out, 4, tok.pad_token_id)
    holes = batch["response_attention_mask"] - batch["response_mask"]
    assert holes.sum() > 0 and (holes >= 0).all()  # observations: attended, not trained
    policy = load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        lp, _ = response_logprobs(policy, batch.input_ids, batch.attention_mask, batch["responses"].shape[1], 0.7)
    sampled = batch["response_mask"].bool()
    assert (lp[sampled] - batch["rollout_logprobs"][sampled]).abs().max() < 1e-4
    assert (batch["rollout_logprobs"][holes.bool()] == 0).all()


def test_the_token_budget_bounds_a_trajectory(tiny_model, tmp_path):
    _, _, _, out, trajectories = run_loop(tiny_model, tmp_path, max_total_tokens=30)
    assert max(len(ids) for ids in out.token_ids) <= 30
    assert "length" in out.finish_reasons


def test_every_turn_of_every_trajectory_has_its_own_seed(tiny_model, tmp_path):
    """What engines that seed each request (vllm, sglang) need so that a trajectory samples the same
    whatever call its turn lands in (the eager schedule)."""
    _, engine, _, _, _ = run_loop(tiny_model, tmp_path)
    assert all(len(c[2].seeds) == len(c[0]) for c in engine.calls)  # every prompt of a call has a seed
    seeds = [s for c in engine.calls for s in c[2].seeds]
    assert len(set(seeds)) == len(seeds)  # one per trajectory and turn


# -- tools, parsers, environments -------------------------------------------------------------


def test_hermes_parser_reads_calls_and_reports_malformed_ones():
    p = HermesParser(None, None)
    turn = 'x <tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call> y'
    (call,) = p.parse(turn)
    assert (call.name, call.arguments, call.error) == ("calculator", {"expression": "2+2"}, None)
    (bad,) = p.parse("<tool_call>{name: calculator}</tool_call>")
    assert bad.error.startswith("the tool call is not valid JSON")
    (unclosed,) = p.parse('<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"1\\"}"}')
    assert unclosed.arguments == {"code": "1"}  # arguments as a JSON string, block not closed
    assert p.parse("no calls here") == []


def tools_env():
    from hybridrl.builtin.environments import ToolEnvironment

    env = ToolEnvironment(ToolEnvironment.Options(), None)
    env.tools = {"calculator": Calculator(Calculator.Options(), None)}
    env.parser = HermesParser(None, None)
    return env


def call(name, **arguments):
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def test_tool_environment_answers_with_results_and_errors():
    env = tools_env()
    obs = env.step(None, call("calculator", expression="12 * (3 + 4)") + call("weather", city="Paris"))
    assert [m["content"] for m in obs.messages] == ["84", "error: unknown tool 'weather'. Tools: calculator."]
    assert obs.info == {"tool_calls": 2, "tool_errors": 1} and not obs.done
    obs = env.step(None, call("calculator", expression="__import__('os')"))
    assert obs.messages[0]["content"].startswith("error: ValueError: only numbers")
    assert env.step(None, "The answer is 84.").done  # no call: the final answer


@pytest.fixture(scope="module")
def python_tool():
    cls = plugins.lookup("tool", "python")  # from the hybridrl-reward-python plugin
    return cls(cls.Options(timeout_s=5, cpu_s=2, memory_mb=256), None)


@pytest.mark.parametrize(
    "code, error",
    [
        ("while True: pass", "more than 2 s of CPU"),
        ("x = bytearray(2**30)", "MemoryError"),
        ("import socket; socket.create_connection(('127.0.0.1', 9))", "Not supported|no attribute 'getaddrinfo'"),
        (
            f"open({os.path.join(os.path.expanduser('~'), 'hybridrl-sandbox-test')!r}, 'w')",
            "Capabilities insufficient|No such file",
        ),
        ("import subprocess; subprocess.run(['true'])", "wasi does not support processes"),
        ("import time; time.sleep(30)", "longer than 5 s"),
    ],
)
def test_python_tool_limits_hold(python_tool, code, error):
    with pytest.raises((TimeoutError, RuntimeError), match=error):
        python_tool({"code": code})
    assert not os.path.exists(os.path.join(os.path.expanduser("~"), "hybridrl-sandbox-test"))


def test_python_tool_runs_code_and_writes_only_in_its_folder(python_tool):
    assert python_tool({"code": "print(sum(range(10)))"}) == "45\n"
    assert python_tool({"code": "open('a.txt', 'w').write('hi'); print(open('a.txt').read())"}) == "hi\n"


class Plugins:
    @hookimpl
    def register_environments(self, register):
        register("go_on", GoOn)
        register("broken", Broken)
        register("holding", Holding)


class Holding(Environment):
    """Drives its own agent (one fixed token per episode); a training call is answered with one
    group, the previous training call's first row (held, as for a late reward), or its own first
    row at the first call; evaluation with its own rows."""

    drives = True
    held = None

    def rollout(self, rows, messages, sampling, loop, train=False):
        def group(row, chat):
            text = loop.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            prompt = loop.tokenizer(text, add_special_tokens=False)["input_ids"]
            return [Trajectory(0, prompt, chat, {}, [28], [-0.5], [1], row=row if train else None)] * sampling.n

        if not train:
            return [t for row, chat in zip(rows, messages) for t in group(row, chat)]
        answer = group(*(self.held or (rows[0], messages[0])))
        self.held = rows[0], messages[0]
        return answer


class Broken(Environment):
    def step(self, state, turn):
        raise KeyError("no such state")


def run_config(model, run_dir, agent, **rollout):
    return {
        "model": {"path": model},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 16},
        "rollout": {"n": 4, "max_tokens": 16, "stop": ["e", "t"], "agent": agent, **rollout},
        "rewards": [{"function": "sevens"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.01},
        "trainer": {"steps": 2, "prompts_per_step": 2, "lr": 1e-2, "run_dir": str(run_dir)},
        "logging": {"loggers": ["jsonl"]},
    }


def test_multi_turn_grpo_trains_on_sampled_tokens(tiny_model, tmp_path, register_plugin):
    from hybridrl.run import build_run
    from hybridrl.trainer import Trainer

    register_plugin(Plugins(), name="agent-plugins")
    register_plugin(SevensPlugin(), name="sevens")
    cfg = run_config(tiny_model, tmp_path / "run", {"environment": "go_on", "max_turns": 3})
    metrics = Trainer(build_run(load_config(data=cfg))).train()
    assert metrics["agent/turns_mean"] > 1 and metrics["agent/observation_tokens_mean"] > 0
    assert metrics["rollout/logprob_diff_max"] < 1e-4  # engine and trainer agree on every sampled token
    assert metrics["agent/trajectory_length_mean"] > metrics["response_length/mean"]


def test_an_environment_that_raises_is_named(tiny_model, tmp_path, register_plugin):
    from hybridrl.run import build_run
    from hybridrl.trainer import Trainer

    register_plugin(Plugins(), name="agent-plugins")
    register_plugin(SevensPlugin(), name="sevens")
    cfg = run_config(tiny_model, tmp_path / "run", {"environment": "broken"})
    with pytest.raises(StageError, match="environment 'broken' failed in step: KeyError: 'no such state'"):
        Trainer(build_run(load_config(data=cfg))).train()


def test_a_driving_environment_may_answer_a_training_call_with_held_groups(tiny_model, tmp_path, register_plugin):
    from hybridrl.run import build_run

    register_plugin(Plugins(), name="agent-plugins")
    register_plugin(SevensPlugin(), name="sevens")
    run = build_run(load_config(data=run_config(tiny_model, tmp_path / "run", {"environment": "holding"})))
    start = run.rollout.order.state_dict()
    rows = [[run.data[i] for i in run.rollout.order.take(2)] for _ in range(2)]
    run.rollout.order.load_state_dict(start)
    first, second = run.rollout.generate(1), run.rollout.generate(2)
    # the first call: one group (its first row), not two; the second: the first call's first row
    assert len(first) == len(second) == 4 and first["group_ids"].tolist() == [0] * 4
    for batch, row in ((first, rows[0][0]), (second, rows[0][0])):
        assert batch["row"] == [row] * 4 and batch["answer"] == [row["answer"]] * 4
        assert batch["messages"][0][-1]["content"] == row["question"] and row["question"] in batch["prompt_text"][0]
    assert rows[1][0]["question"] not in second["prompt_text"][0]
    evaluated = run.rollout.respond(rows[1], run.session.sampling(3))  # evaluation: its own rows, all of them
    assert evaluated["row"] == [rows[1][0]] * 4 + [rows[1][1]] * 4
    run.close()


def test_agent_config_errors_name_the_choices(tiny_model, tmp_path, register_plugin):
    register_plugin(SevensPlugin(), name="sevens")
    with pytest.raises(
        ConfigError, match=r"Unknown environment 'gym' \(rollout.agent.environment\). Available: .*tools"
    ):
        load_config(data=run_config(tiny_model, tmp_path, {"environment": "gym"}))
    with pytest.raises(
        ConfigError, match=r"Unknown tool 'shell' \(rollout.agent.tools\). Available: calculator, python"
    ):
        load_config(data=run_config(tiny_model, tmp_path, {"environment": "tools", "tools": ["shell"]}))
    with pytest.raises(
        ConfigError, match="tool_options has options for python, which rollout.agent.tools does not list"
    ):
        load_config(data=run_config(tiny_model, tmp_path, {"environment": "tools", "tool_options": {"python": {}}}))
    with pytest.raises(
        ConfigError, match=r"tool_options.python \(tool 'python'\). Did you mean 'timeout_s'\? Valid keys"
    ):
        agent = {"environment": "tools", "tools": ["python"], "tool_options": {"python": {"timeout": 3}}}
        load_config(data=run_config(tiny_model, tmp_path, agent))
