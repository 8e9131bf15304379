"""Agents written with the frameworks users run, unmodified, from the package registry, against the
gateway with the real SmolLM2-135M-Instruct: the OpenAI Agents SDK, LangGraph, smolagents and
mini-swe-agent. For each, every episode is recorded whole, the trained ids are exactly what the
engine sampled for each call plus what came between, and the engine's logprobs equal the trainer's.
The tool-calling frameworks run with ``smollm2_tools`` (the model taught the add task's calls), so
their tool loops run: a sampled call, the framework's tool, its result sent back, the answer.
"""

import asyncio

import pytest
import torch
from hybridrl_agents.harness import HarnessEnvironment

from hybridrl.batch import Batch
from hybridrl.builtin.environments import HermesParser
from hybridrl.components import SamplingParams
from hybridrl.config import AgentConfig, RolloutConfig
from hybridrl.models import load_causal_lm
from hybridrl.passes import response_logprobs

TEMPERATURE = 0.8


MAX_TOKENS = 40  # a call of final_answer and its end token take 29


def parts(model, tmp_path_factory, recorded_loop):
    rollout = RolloutConfig(n=2, max_tokens=MAX_TOKENS, temperature=TEMPERATURE)
    agent = AgentConfig(environment="harness", max_total_tokens=2048)
    ctx, engine, loop = recorded_loop(model, tmp_path_factory.mktemp("run"), rollout, agent)
    return ctx, engine, loop, load_causal_lm(model, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def smol(smollm2_tools, tmp_path_factory, recorded_loop):
    return parts(smollm2_tools, tmp_path_factory, recorded_loop)


@pytest.fixture(scope="module")
def plain(smollm2, tmp_path_factory, recorded_loop):
    return parts(smollm2, tmp_path_factory, recorded_loop)


def run_agent(smol, agent, n=2):
    """``n`` episodes of ``agent`` on one task (a task of its own: the run folder is shared)."""
    ctx, engine, loop, policy = smol
    env = HarnessEnvironment(HarnessEnvironment.Options(callable="os:getcwd", answer="returned"), ctx)
    env.agent, env.parser = agent, HermesParser(None, None)
    loop.env = env
    engine.calls.clear()
    try:
        chats = [[{"role": "user", "content": "What is 2 + 3? Use the add tool."}]]
        rows = [{"task": "add", "agent": agent.__qualname__}]
        sampling = SamplingParams(n=n, max_tokens=MAX_TOKENS, temperature=TEMPERATURE, seed=3)
        return loop.run([[0]], rows, chats, sampling)
    finally:
        env.close()


def assert_token_exact(smol, out, trajectories):
    """Each sampled stretch of each trajectory is what the engine answered to a prompt that is the
    trajectory's prompt and everything before that stretch; engine and trainer logprobs agree."""
    ctx, engine, loop, policy = smol
    answered = [(p, ids) for prompts, o in engine.calls for p, ids in zip(prompts, o.token_ids)]
    for t in trajectories:
        assert t.state["lost"] is None, t.state["lost"]
        assert t.ids and t.info["calls"] >= 1
        start = 0
        while start < len(t.ids):
            end = start
            while end < len(t.ids) and t.sampled[end] == t.sampled[start]:
                end += 1
            if t.sampled[start]:  # a call's answer: sampled for exactly this context
                context = t.prompt + t.ids[:start]
                assert any(p == context and ids[: end - start] == t.ids[start:end] for p, ids in answered)
            start = end
    batch = Batch.from_rollout([t.prompt for t in trajectories], out, 1, ctx.tokenizer.pad_token_id)
    with torch.no_grad():
        lp, _ = response_logprobs(
            policy, batch.input_ids, batch.attention_mask, batch["responses"].shape[1], TEMPERATURE
        )
    sampled = batch["response_mask"].bool()
    assert (lp[sampled] - batch["rollout_logprobs"][sampled]).abs().max() < 1e-3


def tool_loops(smol, trajectories, result: str) -> list:
    """The episodes whose policy called ``add``: the framework ran it and sent ``result`` back, which
    the trajectory holds as tokens the policy did not sample, and the policy answered after it."""
    tokenizer = smol[0].tokenizer
    loops = [t for t in trajectories if t.info["tool_calls"] >= 1]
    assert loops, [t.info for t in trajectories]
    for t in loops:
        given = tokenizer.decode([i for i, sampled in zip(t.ids, t.sampled) if not sampled])
        assert f"<tool_response>\n{result}\n</tool_response>" in given
        assert t.sampled[-1] == 1  # the last call's answer, after the result
    return loops


def test_an_openai_agents_sdk_agent(smol):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)

    @agents.function_tool
    def add(a: float, b: float) -> float:
        """Add two numbers."""
        return a + b

    def solve(task):
        client = AsyncOpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
        model = agents.OpenAIChatCompletionsModel(model="policy", openai_client=client)
        agent = agents.Agent(name="adder", instructions="Add numbers with the add tool.", tools=[add], model=model)
        return str(asyncio.run(agents.Runner.run(agent, task.prompt, max_turns=3)).final_output)

    out, trajectories = run_agent(smol, solve)
    assert_token_exact(smol, out, trajectories)
    assert all(t.last_text for t in trajectories)
    # the SDK sends the call and its result back as they were: the episode continues, no fork
    for t in tool_loops(smol, trajectories, "5.0"):
        assert t.info["calls"] == 2 and t.info["forks"] == 0 and "5" in t.last_text


def test_a_langgraph_react_agent(smol):
    pytest.importorskip("langgraph")
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    @tool
    def add(a: float, b: float) -> float:
        """Add two numbers."""
        return a + b

    def solve(task):
        llm = ChatOpenAI(model="policy", base_url=task.base_url, api_key=task.api_key, max_retries=0)
        graph = create_react_agent(llm, [add])
        result = graph.invoke({"messages": [("user", task.prompt)]}, {"recursion_limit": 7})
        return result["messages"][-1].content

    out, trajectories = run_agent(smol, solve)
    assert_token_exact(smol, out, trajectories)
    for t in tool_loops(smol, trajectories, "5.0"):
        assert t.info["calls"] == 2 and t.info["forks"] == 0 and "5" in t.last_text


def test_a_smolagents_tool_calling_agent(smol):
    smolagents = pytest.importorskip("smolagents")

    @smolagents.tool
    def add(a: float, b: float) -> float:
        """Add two numbers.

        Args:
            a: the first number
            b: the second number
        """
        return a + b

    def solve(task):
        model = smolagents.OpenAIServerModel(model_id="policy", api_base=task.base_url, api_key=task.api_key)
        agent = smolagents.ToolCallingAgent(tools=[add], model=model, max_steps=2, verbosity_level=0)
        return str(agent.run(task.prompt))

    out, trajectories = run_agent(smol, solve)
    assert_token_exact(smol, out, trajectories)
    tokenizer = smol[0].tokenizer
    for t in trajectories:
        # it calls add, then its final_answer tool, with the answer from add's result
        assert t.info["calls"] == 2 and t.info["tool_calls"] == 2 and t.last_text == "5"
        # it sends the call back as text of its own ("Calling tools: ...") and the result as a user
        # message: the second call rewrote the history, so it forks; both branches train
        assert t.info["forks"] == 1 and t.info["trained_branches"] == 2
        assert "Observation:\n5" in tokenizer.decode(t.prompt) and all(t.sampled)


def test_mini_swe_agent_on_a_tiny_repository(plain, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm reads its price list offline
    pytest.importorskip("minisweagent")
    import yaml
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.config import builtin_config_dir
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_model import LitellmModel

    config = yaml.safe_load((builtin_config_dir / "mini.yaml").read_text())["agent"]

    def solve(task):
        (task.workdir / "calc.py").write_text("def add(a, b):\n    return a - b\n")
        model = LitellmModel(
            model_name="openai/policy",
            model_kwargs={"api_base": task.base_url, "api_key": task.api_key},
            cost_tracking="ignore_errors",
        )
        # the model's commands run in the episode's throw-away folder, with nothing on PATH
        env = LocalEnvironment(cwd=str(task.workdir), env={"PATH": str(task.workdir / "no-bin")}, timeout=5)
        agent = DefaultAgent(model, env, **config | {"step_limit": 3})
        return agent.run("Fix calc.py so that add(2, 3) returns 5.").get("exit_status", "")

    out, trajectories = run_agent(plain, solve)
    assert_token_exact(plain, out, trajectories)
    # a reply without a command is dropped from its history (a format error takes its place): the
    # next call rewrote the history, so it forks, and the trained branch is the last call's
    assert all(t.info["calls"] >= 2 and t.info["forks"] == t.info["calls"] - 1 for t in trajectories)
    assert all(t.last_text in ("RepeatedFormatError", "LimitsExceeded") for t in trajectories)
