"""A verifiers environment as a hybridrl environment and prompt source.

The environment runs unchanged, with its dataset, rubric and protocol, in a process of its own: the
runner (:mod:`hybridrl_env_verifiers.runner`) under the interpreter that has verifiers installed.
Each episode is one of the harness environment's (hybridrl-agents): the runner runs verifiers'
``run_episode`` for the task with its model calls sent to the episode's base URL on the agent
gateway, which records the exact ids; the rubric's reward is posted to the episode (the ``posted``
reward function gives it); an episode verifiers reports as failed is lost, with its errors named.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path

from hybridrl_agents.harness import HarnessEnvironment, HarnessOptions
from pydantic import Field, model_validator

from hybridrl.components import INPUT_PATH, Options, PromptSource
from hybridrl.errors import ConfigError

RUNNER = Path(__file__).with_name("runner.py")
RESULT = "RESULT "


class VerifiersConfig(Options):
    config: dict = Field(
        ...,
        description="The verifiers environment, as verifiers' own EnvConfig mapping: its taskset ({'id': ...}, "
        "found by module name) and agent (harness, runtime: subprocess unless set).",
    )
    python: str | None = Field(
        None,
        description="The interpreter that has verifiers 0.4 installed (it pins openai<3: give it a virtual "
        "environment of its own); default: the one that runs hybridrl.",
        json_schema_extra=INPUT_PATH,
    )
    env: dict[str, str] = Field(default_factory=dict, description="More environment variables for the runner.")


class VerifiersSourceOptions(VerifiersConfig):
    pass


class VerifiersOptions(HarnessOptions, VerifiersConfig):
    @model_validator(mode="after")
    def _one_agent(self):
        if self.command is not None or self.callable is not None:
            raise ValueError("the verifiers environment runs the environment's own agent: remove command/callable")
        if self.answer != "reply":
            raise ValueError("answer: the verifiers environment's answer is the episode's last reply")
        return self


def runner_env(options) -> dict[str, str]:
    return os.environ | options.env | {"HYBRIDRL_VERIFIERS_ENV": json.dumps(options.config)}


def interpreter(options) -> str:
    python = options.python or sys.executable
    if not Path(python).exists():
        raise ConfigError(f"verifiers: python '{python}' does not exist; name an interpreter with verifiers installed")
    return python


class VerifiersSource(PromptSource):
    """The taskset's tasks, listed once by the runner: ``{"idx", "id", "name", "prompt"}`` rows."""

    Options = VerifiersSourceOptions

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        argv = [interpreter(options), str(RUNNER), "list"]
        done = subprocess.run(argv, env=runner_env(options), capture_output=True, text=True, timeout=600)
        if done.returncode:
            tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1][:400]
            raise ConfigError(f"verifiers: cannot list the tasks of {json.dumps(options.config)}: {tail}")
        self.rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.rows[index]


class Runner:
    """The runner process: requests written to its stdin, results read from its stdout by a thread.
    It ends when its stdin does, so with the trainer, even one killed with SIGKILL (the kernel's
    parent-death signal would fire when the episode thread that started it ends)."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, start_new_session=True
        )
        self.pending: dict[int, Future] = {}
        self.ids, self.lock = itertools.count(), threading.Lock()
        threading.Thread(target=self._read, name="hybridrl-verifiers-runner", daemon=True).start()

    def run(self, request: dict) -> dict:
        future: Future = Future()
        with self.lock:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the verifiers runner has exited (status {self.proc.returncode})")
            request_id = next(self.ids)
            self.pending[request_id] = future
            self.proc.stdin.write(json.dumps(request | {"id": request_id}) + "\n")
            self.proc.stdin.flush()
        return future.result()  # the harness stops waiting at timeout_s

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                result = json.loads(line[len(RESULT) :])
                with self.lock:
                    future = self.pending.pop(result["id"], None)
                if future is not None:
                    future.set_result(result)
            else:
                sys.stderr.write(f"verifiers: {line}")  # what the environment printed
        code = self.proc.wait()
        with self.lock:
            waiting, self.pending = list(self.pending.values()), {}
        for future in waiting:
            future.set_exception(RuntimeError(f"the verifiers runner exited (status {code}); its stderr says why"))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class VerifiersEnvironment(HarnessEnvironment):
    """A verifiers environment's episodes, each run by the runner against its episode's base URL."""

    Options = VerifiersOptions

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.python = interpreter(options)
        self.name = (
            f"verifiers {json.dumps(options.config, sort_keys=True)}"  # the store's key: another env, other episodes
        )
        self.agent = self._verifiers_episode
        self.runner: Runner | None = None
        self.starting = threading.Lock()

    def _verifiers_episode(self, task) -> str:
        with self.starting:
            if self.runner is None or self.runner.proc.poll() is not None:
                env = runner_env(self.options) | {"HYBRIDRL_GATEWAY_KEY": task.api_key}
                self.runner = Runner([self.python, str(RUNNER), "serve"], env)
        result = self.runner.run({"idx": task.row["idx"], "base_url": task.base_url, "model": "policy"})
        if not result["ok"]:
            raise RuntimeError("; ".join(result["errors"])[:400] or "verifiers reported the episode failed")
        if result["reward"] is not None:
            self.gateway.post_reward(task.episode_id, {"reward": result["reward"]})
        return result["answer"]

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
        super().close()
