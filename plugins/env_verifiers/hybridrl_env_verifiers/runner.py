"""Runs a verifiers environment for hybridrl, in the interpreter that has verifiers installed.

This file imports nothing of hybridrl: it runs as ``PYTHON runner.py list|serve`` under the
interpreter named by the plugin's ``python`` option (verifiers 0.4 pins ``openai<3``, so it often
lives in a virtual environment of its own). The environment is the mapping in
``$HYBRIDRL_VERIFIERS_ENV`` (verifiers' own EnvConfig: ``taskset``, ``agent``, ...).

- ``list`` prints the taskset's tasks, one JSON object per line.
- ``serve`` reads requests, one JSON object per line (``{"id", "idx", "base_url", "model"}``), runs
  each task's episode concurrently on one event loop, its model calls sent to ``base_url`` (an
  episode of hybridrl's agent gateway) with the key in ``$HYBRIDRL_GATEWAY_KEY``, and prints
  ``RESULT {"id", "reward", "ok", "errors", "answer"}`` lines.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

RESULT = "RESULT "


def environment():
    import verifiers.v1 as vf

    config = json.loads(os.environ["HYBRIDRL_VERIFIERS_ENV"])
    agent = config.setdefault("agent", {})
    if isinstance(agent, dict):
        agent.setdefault("runtime", {"type": "subprocess"})  # verifiers' default is its cloud
    return vf, vf.load_environment(vf.resolve_env_config(config))


def prompt_of(data) -> str | list[dict]:
    """A task's opening: its prompt's messages (the system prompt first), or its text."""
    prompt = data.prompt
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(prompt, str) or prompt is None:
        text = prompt or data.description or data.name or str(data.id)
        return messages + [{"role": "user", "content": text}] if messages else text
    return messages + [m.model_dump(mode="json", exclude_none=True) for m in prompt]


def list_tasks() -> None:
    _, env = environment()
    for task in env.taskset:
        data = task.data
        row = {"idx": data.idx, "id": data.id, "name": data.name, "prompt": prompt_of(data)}
        print(json.dumps(row, default=str), flush=True)


async def serve() -> None:
    vf, env = environment()
    tasks = list(env.taskset)
    loop = asyncio.get_running_loop()
    running = set()

    async def episode(request: dict) -> None:
        out = {"id": request["id"], "reward": None, "ok": False, "errors": [], "answer": ""}
        try:
            ctx = vf.ModelContext(
                model=request.get("model", "policy"),
                client=vf.EvalClientConfig(base_url=request["base_url"], api_key_var="HYBRIDRL_GATEWAY_KEY"),
                sampling=vf.SamplingConfig(),  # the run's sampling: the gateway refuses any other
            )
            result = await env.run_episode(tasks[request["idx"]], ctx)
            traces = result.traces
            if len(traces) != 1:
                raise RuntimeError(f"the episode has {len(traces)} agents; hybridrl trains single-agent environments")
            trace = traces[0]
            errors = [str(getattr(e, "message", e)) for e in [*result.errors, *trace.errors]]
            out |= {"reward": trace.reward, "ok": bool(trace.ok and result.ok), "errors": errors}
            out["answer"] = trace.last_reply or ""
        except Exception as e:  # the episode's failure, reported; the runner goes on
            out["errors"] = [f"{type(e).__name__}: {e}"]
        print(RESULT + json.dumps(out, default=str), flush=True)

    async with env.serving():
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            task = asyncio.ensure_future(episode(json.loads(line)))
            running.add(task)
            task.add_done_callback(running.discard)
        if running:
            await asyncio.wait(running)


if __name__ == "__main__":
    if sys.argv[1:] == ["list"]:
        list_tasks()
    elif sys.argv[1:] == ["serve"]:
        asyncio.run(serve())
    else:
        sys.exit("usage: runner.py list|serve")
