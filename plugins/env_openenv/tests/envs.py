"""OpenEnv environments written as their authors write them (openenv-core's base classes), for the
plugin's tests: none ships with openenv-core, and the hub's are installed from Spaces."""

import random
from typing import Annotated
from uuid import uuid4

from fastmcp import FastMCP
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class WordAction(Action):
    message: str


class GuessAction(Action):
    guess: int


class TextObservation(Observation):
    prompt: str = ""


class GuessState(State):
    target: int = 0


class WordEnv(Environment[WordAction, TextObservation, State]):
    """Two rounds of "write a word with the letter e"; a round's reward is the share of e's."""

    def __init__(self, rounds: int = 2):
        super().__init__()
        self.rounds, self._state = rounds, State()

    def reset(self, seed=None, episode_id=None, **kw) -> TextObservation:
        self._state = State(episode_id=episode_id or str(uuid4()))
        letter = "e" if seed is None else "aeiou"[seed % 5]
        self.letter = letter
        return TextObservation(prompt=f"Write a word with the letter '{letter}'. Round 1 of {self.rounds}.")

    def step(self, action: WordAction, timeout_s=None, **kw) -> TextObservation:
        self._state.step_count += 1
        text = action.message[:50]
        reward = text.count(self.letter) / max(1, len(text))
        done = self._state.step_count >= self.rounds
        return TextObservation(prompt=f"Round {self._state.step_count + 1}: another one.", reward=reward, done=done)

    @property
    def state(self) -> State:
        return self._state


class GuessEnv(Environment[GuessAction, TextObservation, GuessState]):
    """Guess an integer in [1, 100] (a JSON action: {"guess": n})."""

    def __init__(self):
        super().__init__()
        self._state = GuessState()

    def reset(self, seed=None, episode_id=None, **kw) -> TextObservation:
        self._state = GuessState(target=random.Random(seed).randint(1, 100))
        return TextObservation(prompt='Guess my integer in [1, 100]. Reply {"guess": n}.')

    def step(self, action: GuessAction, timeout_s=None, **kw) -> TextObservation:
        self._state.step_count += 1
        if action.guess == self._state.target:
            return TextObservation(prompt="Correct!", reward=1.0, done=True)
        hint = "higher" if action.guess < self._state.target else "lower"
        return TextObservation(prompt=f"{action.guess} is wrong: go {hint}.", reward=0.0)

    @property
    def state(self) -> GuessState:
        return self._state


class GuessToolEnv(MCPEnvironment):
    """The guessing game with a `guess` tool (FastMCP, in memory); a right guess rewards 1 and ends it."""

    def __init__(self):
        mcp, env = FastMCP("guess-tools"), self

        @mcp.tool()
        def guess(n: Annotated[int, Field(description="your integer guess")]) -> str:
            """Submit a guess for the hidden number. Returns 'correct', 'higher' or 'lower'."""
            env._state.step_count += 1
            if n == env._state.target:
                env._reward, env._done = 1.0, True
                return "correct"
            return "higher" if n < env._state.target else "lower"

        super().__init__(mcp)
        self._state, self._reward, self._done = GuessState(), 0.0, False

    def reset(self, seed=None, episode_id=None, **kw) -> TextObservation:
        self._state = GuessState(target=random.Random(seed).randint(1, 100))
        self._reward, self._done = 0.0, False
        return TextObservation(prompt="Find my integer in [1, 100] with the `guess` tool.")

    def step(self, action, timeout_s=None, **kw):
        obs = super().step(action, timeout_s=timeout_s, **kw)
        if isinstance(action, CallToolAction):
            obs.reward, obs.done = self._reward, self._done
        return obs

    def _step_impl(self, action, timeout_s=None, **kw) -> Observation:
        return Observation(metadata={"error": f"unsupported action {type(action).__name__}"})

    @property
    def state(self) -> GuessState:
        return self._state
