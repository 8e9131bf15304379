"""An OpenEnv environment, run in this process, as a hybridrl multi-turn environment and prompt source.

OpenEnv (``openenv-core``) environments are Gym-like: ``reset(seed=...)`` gives the first
observation, ``step(action)`` the next one with its ``reward`` and ``done``. Here every trajectory
gets an instance of its own (an environment keeps its episode on ``self``), reset with its row's
seed; the prompt source gives each seed's first observation as the prompt, so the model sees what
the environment said.

- **An MCP environment** (``MCPEnvironment``) brings its tools: their schemas are shown to the model
  in the chat template, its tool calls (read by the run's parser) become ``CallToolAction``s, the
  results come back as tool messages. A turn without a call ends the trajectory: it is the answer.
- **Any other environment** takes the reply as its action: the text itself when the action has one
  required string field (or ``action_field``), else the reply read as a JSON object of the
  action's fields. A reply that is neither is answered with what the action expects, and counted.

The observation the model sees is its fields other than ``done``, ``reward`` and ``metadata``: the
value itself when there is one, else JSON.
"""

from __future__ import annotations

import json
import sys
import typing

from pydantic import Field, ValidationError

from hybridrl.components import INPUT_PATH, Environment, Observation, Options, PromptSource
from hybridrl.errors import ConfigError
from hybridrl.plugins import load_object

HIDDEN = {"done", "reward", "metadata"}


class EnvOptions(Options):
    env: str = Field(
        ...,
        description="The OpenEnv environment class, 'module:Class' or 'file.py:Class' (a subclass of openenv's "
        "Environment), run in this process.",
        json_schema_extra=INPUT_PATH,
    )
    kwargs: dict = Field(default_factory=dict, description="Keyword arguments the class is built with.")


class OpenEnvOptions(EnvOptions):
    action_field: str | None = Field(
        None,
        description="The action's field that takes the reply's text; default: its one required field when that "
        "is a string, else the reply is read as a JSON object of the action's fields.",
    )


class SourceOptions(EnvOptions):
    size: int = Field(64, gt=0, description="Episodes: rows with the seeds seed, seed + 1, ... .")
    seed: int = Field(0, description="The first row's seed.")


def environment_class(spec: str):
    """The environment class ``spec`` names, checked to be an OpenEnv Environment."""
    from openenv.core.env_server.interfaces import Environment as OpenEnvEnvironment

    try:
        cls = load_object(spec)
    except (ImportError, OSError, ValueError) as e:
        raise ConfigError(f"openenv: cannot load env '{spec}': {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, OpenEnvEnvironment)):
        module = sys.modules.get(getattr(cls, "__module__", ""), None)
        found = sorted(
            k for k, v in (vars(module) if module else {}).items()
            if isinstance(v, type) and issubclass(v, OpenEnvEnvironment) and v.__module__ == cls.__module__
        )  # fmt: skip
        raise ConfigError(
            f"openenv: env '{spec}' is not an OpenEnv Environment class; its module has: {', '.join(found) or 'none'}"
        )
    return cls


def observation_text(obs) -> str:
    """What the model sees of an observation: its own fields, the value itself when there is one."""
    fields = {k: v for k, v in obs.model_dump(mode="json").items() if k not in HIDDEN}
    if len(fields) == 1:
        (value,) = fields.values()
        return value if isinstance(value, str) else json.dumps(value)
    return json.dumps(fields)


def tool_result_text(obs) -> str:
    """A CallToolObservation's result (or error) as the text of a tool message."""
    if obs.error is not None:
        return f"error ({obs.error.error_type.value}): {obs.error.message}"
    result = obs.result
    content = getattr(result, "content", None)
    if content:
        return "\n".join(getattr(part, "text", str(part)) for part in content)
    data = getattr(result, "data", result)
    return data if isinstance(data, str) else json.dumps(data, default=str)


class OpenEnvSource(PromptSource):
    """One row per seed: ``{"seed": s, "prompt": the first observation of reset(seed=s)}``."""

    Options = SourceOptions

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.cls = environment_class(options.env)
        self.rows: dict[int, dict] = {}

    def __len__(self) -> int:
        return self.options.size

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < len(self):
            raise IndexError(index)
        if index not in self.rows:
            seed = self.options.seed + index
            env = self.cls(**self.options.kwargs)
            try:
                self.rows[index] = {"seed": seed, "prompt": observation_text(env.reset(seed=seed))}
            finally:
                env.close()
        return self.rows[index]


class OpenEnvEnvironment(Environment):
    """An OpenEnv environment per trajectory, stepped with each sampled turn."""

    Options = OpenEnvOptions

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        from openenv.core.env_server.mcp_environment import MCPEnvironment
        from openenv.core.env_server.mcp_types import ListToolsAction

        self.cls = environment_class(options.env)
        self.mcp = issubclass(self.cls, MCPEnvironment)
        self.action, self.field = None, None
        if self.mcp:
            probe = self.cls(**options.kwargs)
            try:
                tools = probe.step(ListToolsAction()).tools
            finally:
                probe.close()
            self.schemas = [
                {"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.input_schema}}
                for t in tools
            ]  # fmt: skip
        else:
            self.action, self.field = action_of(self.cls, options.action_field)

    def reset(self, row: dict, messages: list[dict]):
        env = self.cls(**self.options.kwargs)
        env.reset(seed=row.get("seed"))  # the prompt source showed the model this first observation
        return {"env": env}

    def step(self, state, turn: str) -> Observation:
        obs = self._tools(state["env"], turn) if self.mcp else self._act(state["env"], turn)
        if obs.done:
            state["env"].close()
        return obs

    def _act(self, env, turn: str) -> Observation:
        try:
            action = self.action(**{self.field: turn}) if self.field else self.action(**json.loads(turn))
        except (ValueError, TypeError, ValidationError) as e:
            fields = ", ".join(k for k in self.action.model_fields if k not in HIDDEN)
            want = f"'{self.field}'" if self.field else f"a JSON object of {fields}"
            text = f"Invalid action: the reply must be {want} ({type(e).__name__})."
            return Observation([{"role": "user", "content": text}], info={"invalid_actions": 1})
        obs = env.step(action)
        return Observation([{"role": "user", "content": observation_text(obs)}], bool(obs.done), obs.reward)

    def _tools(self, env, turn: str) -> Observation:
        from openenv.core.env_server.mcp_types import CallToolAction

        calls = self.parser.parse(turn)
        if not calls:
            return Observation(done=True)  # no call: the reply is the answer
        messages, reward, done, info = [], None, False, {"tool_calls": len(calls)}
        for call in calls:
            if call.error:
                text = f"error: {call.error}"
                info["tool_errors"] = info.get("tool_errors", 0) + 1
            else:
                obs = env.step(CallToolAction(tool_name=call.name, arguments=call.arguments))
                text, done = tool_result_text(obs), done or bool(obs.done)
                info["tool_errors"] = info.get("tool_errors", 0) + (obs.error is not None)
                reward = reward if obs.reward is None else (reward or 0.0) + obs.reward
            messages.append({"role": "tool", "name": call.name, "content": text})
        return Observation(messages, done, reward, info)


def action_of(cls, field: str | None):
    """The action class ``cls.step`` takes, and the field a reply's text goes to (None: JSON)."""
    hints = typing.get_type_hints(cls.step)
    action = hints.get("action")
    if not isinstance(action, type) or not hasattr(action, "model_fields"):
        raise ConfigError(f"openenv: {cls.__name__}.step does not annotate its action with an Action class")
    if field is not None:
        if field not in action.model_fields:
            raise ConfigError(
                f"openenv: action_field '{field}' is not a field of {action.__name__}: "
                + ", ".join(k for k in action.model_fields if k not in HIDDEN)
            )
        return action, field
    required = [k for k, f in action.model_fields.items() if f.is_required()]
    if len(required) == 1 and action.model_fields[required[0]].annotation is str:
        return action, required[0]
    return action, None
