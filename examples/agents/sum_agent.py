"""An agent as people write them: a loop around OpenAI's client, with one tool it runs itself.
Nothing in it knows about hybridrl: the harness gives it OPENAI_BASE_URL and OPENAI_API_KEY.

    OPENAI_BASE_URL=... OPENAI_API_KEY=... HYBRIDRL_PROMPT="What is 2 + 3?" python sum_agent.py

The same loop as a callable harness (``callable: examples/agents/sum_agent.py:solve``) runs in a
thread of the trainer instead of a process per episode.
"""

import functools
import json
import os

import openai

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"],
        },
    },
}


def answer(client: openai.OpenAI, prompt: str, checks: int = 0) -> str:
    """The model's answer to ``prompt``, running the tool calls it makes; ``checks`` times more it
    is asked to check that answer (each a call continuing the conversation)."""
    messages = [
        {"role": "system", "content": "Solve the problem. Reply with the final answer only, as a number."},
        {"role": "user", "content": prompt},
    ]
    for turn in range(3 + checks):  # tool calls are run, then the model answers; then the checks
        message = client.chat.completions.create(model="policy", messages=messages, tools=[ADD]).choices[0].message
        messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        if not message.tool_calls:
            if checks == 0 or turn == 2 + checks:
                break
            checks -= 1
            messages.append({"role": "user", "content": "Check your answer. Reply with the final answer only."})
            continue
        for call in message.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
                result = str(float(arguments["a"]) + float(arguments["b"]))
            except (ValueError, KeyError, TypeError) as e:
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return message.content or ""


@functools.cache
def shared_client(api_key: str) -> openai.OpenAI:
    """One client for every episode in this process: a new ``openai.OpenAI`` costs about 20 ms of CPU
    (its TLS context), 10 s a step at 512 episodes; ``with_options`` shares its connections."""
    return openai.OpenAI(api_key=api_key, base_url="http://127.0.0.1", max_retries=0)


def client_for(task) -> openai.OpenAI:
    return shared_client(task.api_key).with_options(base_url=task.base_url)


def solve(task) -> str:
    return answer(client_for(task), task.prompt)


def solve_and_check(task) -> str:
    """The same agent, asked once to check its answer: every episode makes two calls or more."""
    return answer(client_for(task), task.prompt, checks=1)


if __name__ == "__main__":
    print(answer(openai.OpenAI(), os.environ["HYBRIDRL_PROMPT"]))
