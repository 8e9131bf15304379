"""An agent as people write them: a loop around OpenAI's client, with one tool it runs itself.
Nothing in it knows about hybridrl: the harness gives it OPENAI_BASE_URL and OPENAI_API_KEY.

    OPENAI_BASE_URL=... OPENAI_API_KEY=... HYBRIDRL_PROMPT="What is 2 + 3?" python sum_agent.py

The same loop as a callable harness (``callable: examples/agents/sum_agent.py:solve``) runs in a
thread of the trainer instead of a process per episode.
"""

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


def answer(client: openai.OpenAI, prompt: str) -> str:
    messages = [
        {"role": "system", "content": "Solve the problem. Reply with the final answer only, as a number."},
        {"role": "user", "content": prompt},
    ]
    for _ in range(3):  # at most three turns: tool calls are run, then the model answers
        message = client.chat.completions.create(model="policy", messages=messages, tools=[ADD]).choices[0].message
        messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
                result = str(float(arguments["a"]) + float(arguments["b"]))
            except (ValueError, KeyError, TypeError) as e:
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return message.content or ""


def solve(task) -> str:
    return answer(openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0), task.prompt)


if __name__ == "__main__":
    print(answer(openai.OpenAI(), os.environ["HYBRIDRL_PROMPT"]))
