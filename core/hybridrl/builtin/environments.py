"""The built-in environment (``tools``: tool calls; ``retry``, feedback and another try, is hybridrl-agents') and
the built-in tool-call parser (``hermes``: the ``<tool_call>`` JSON blocks of Qwen and Hermes templates)."""

from __future__ import annotations

import json
import re

from pydantic import Field

from hybridrl.components import Environment, Observation, Options, ToolCall, ToolParser
from hybridrl.hookspecs import hookimpl

_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


class HermesParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as Qwen2.5/Qwen3 and Hermes
    templates teach it; a block whose JSON does not read is a call with an error."""

    def parse(self, turn: str) -> list[ToolCall]:
        calls = []
        for block in _TOOL_CALL.findall(turn):
            try:
                value = json.loads(block.strip())
            except json.JSONDecodeError as e:
                calls.append(ToolCall("", {}, f"the tool call is not valid JSON ({e.msg} at character {e.pos})"))
                continue
            name = value.get("name") if isinstance(value, dict) else None
            arguments = value.get("arguments", {}) if isinstance(value, dict) else None
            if isinstance(arguments, str):  # some models write the arguments as a JSON string
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    arguments = None
            if not isinstance(name, str) or not isinstance(arguments, dict):
                calls.append(ToolCall(str(name or ""), {}, 'a tool call needs {"name": str, "arguments": {...}}'))
            else:
                calls.append(ToolCall(name, arguments))
        return calls

    def content(self, turn: str) -> str:
        return _TOOL_CALL.sub("", turn).strip()


class ToolEnvironment(Environment):
    """Runs the tool calls of each turn and answers with their results (role ``tool``); a turn without
    a call ends the trajectory (the final answer). Errors go back to the model as results: a call
    that does not parse, an unknown tool (the result lists the tools), an exception, a timeout."""

    class Options(Options):
        max_calls_per_turn: int = Field(4, gt=0, description="Calls of one turn that are run; the rest get an error.")

    def step(self, state, turn: str) -> Observation:
        calls = self.parser.parse(turn)
        if not calls:
            return Observation(done=True)
        messages, errors = [], 0
        for i, call in enumerate(calls):
            result, failed = self._run(call, i)
            errors += failed
            messages.append({"role": "tool", "name": call.name, "content": result})
        return Observation(messages, info={"tool_calls": len(calls), "tool_errors": errors})

    def _run(self, call: ToolCall, index: int) -> tuple[str, bool]:
        if call.error:
            return f"error: {call.error}", True
        if index >= self.options.max_calls_per_turn:
            return f"error: at most {self.options.max_calls_per_turn} tool calls are run per turn", True
        tool = self.tools.get(call.name)
        if tool is None:
            return f"error: unknown tool '{call.name}'. Tools: {', '.join(sorted(self.tools)) or 'none'}.", True
        try:
            return tool(call.arguments), False
        except Exception as e:  # noqa: BLE001 - the model reads what went wrong
            return f"error: {type(e).__name__}: {e}", True


@hookimpl
def register_environments(register):
    register("tools", ToolEnvironment)


@hookimpl
def register_tool_parsers(register):
    register("hermes", HermesParser)
