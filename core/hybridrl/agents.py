"""Multi-turn rollouts: trajectories of sampled turns and environment observations, token in, token out.

A trajectory's response is exactly the tokens the engine sampled, with the tokens of each
observation between turns: the chat template's framing of the observation (its turn markers, a
tool result, the next assistant header) is rendered and tokenised once, on its own, and appended;
the sampled text is never re-tokenised, so the tokens trained on are the tokens sampled. Observation
tokens are attended to but out of the loss (``sampled_masks`` 0, logprob 0).

Each turn of every live trajectory goes to the engine as a prompt of its own (prompt + response so
far), seeded by the trajectory and the turn, so where it lands in a call does not change what it
samples with engines that seed each request. Environment steps and tool calls run in worker
threads; with the ``eager`` schedule a trajectory whose observation is ready is sent to the engine
at once, without waiting for a slow tool of another.
"""

from __future__ import annotations

import concurrent.futures as cf
import inspect
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hybridrl.components import Observation, RolloutOutput, SamplingParams
from hybridrl.errors import StageError, stage_errors

MARK = "\u2063hybridrl-turn\u2063"  # stands for a sampled turn while rendering an observation's framing
TURN_SEED_STRIDE = 100_000_007


@dataclass
class Trajectory:
    index: int  # its place among the call's trajectories (prompt i, sample j: i * n + j)
    prompt: list[int]
    messages: list[dict]  # the chat so far: the prompt's messages, assistant turns, observations
    state: Any = None
    ids: list[int] = field(default_factory=list)  # the response: sampled turns and observations
    logprobs: list[float] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)  # 1 sampled, 0 observation
    versions: list[int] = field(default_factory=list)  # the policy version that sampled each token (the loop's turns)
    turns: int = 0
    last_text: str = ""
    done: bool = False
    finish: str = "stop"
    reward: float = 0.0
    info: Counter = field(default_factory=Counter)
    row: dict | None = None  # a driven episode's task, when its group answers another call (late rewards)
    #: a driven episode's earlier branches (dicts of prompt, ids, logprobs, sampled, finish), trained
    #: beside it with its reward as rows of their own (:func:`hybridrl.batch.with_branches`)
    branches: list[dict] = field(default_factory=list)


def observation_ids(tokenizer, messages: list[dict], tools: list[dict] | None, after: int | None) -> list[int]:
    """The tokens that follow a sampled assistant turn when ``messages`` are appended: the end of
    that turn (unless the turn's last sampled token ``after`` already is it), the messages as the
    chat template frames them, and the header of the next assistant turn."""
    chat = [{"role": "user", "content": "?"}, {"role": "assistant", "content": MARK}, *messages]
    text = tokenizer.apply_chat_template(chat, tools=tools or None, add_generation_prompt=True, tokenize=False)
    cut = text.rfind(MARK)
    if cut < 0:
        raise ValueError("the chat template does not render an assistant message's content as it is")
    suffix = text[cut + len(MARK) :]
    if after is not None:
        sampled_end = tokenizer.decode([after])
        if sampled_end and suffix.startswith(sampled_end):  # the engine sampled the end of the turn
            suffix = suffix[len(sampled_end) :]
    return tokenizer(suffix, add_special_tokens=False)["input_ids"]


class AgentLoop:
    """Runs trajectories for a call's prompts: ``agent`` is the ``rollout.agent`` config section."""

    def __init__(self, session, environment, agent, rollout, tokenizer, end_ids: set[int], tools=None, eager=True):
        self.session, self.env, self.agent, self.rollout = session, environment, agent, rollout
        self.tokenizer, self.end_ids, self.tools = tokenizer, end_ids, tools
        self.eager = eager
        self.budget = agent.max_total_tokens or agent.max_turns * rollout.max_tokens
        self.env_name = f"environment '{agent.environment}'"

    def run(self, prompts, rows: list[dict], messages: list[list[dict]], sampling: SamplingParams, train=False):
        """``RolloutOutput`` (with ``sampled_masks``) for ``sampling.n`` trajectories per prompt, and
        per trajectory: its final assistant text, its messages, its environment reward, its counts.
        An environment that drives its agent may answer a training call (``train``) with fewer groups,
        or groups of earlier rows (held for late rewards; each trajectory's ``row`` says which)."""
        if self.drives:
            trajectories = self._driven(rows, messages, sampling, train)
        else:
            trajectories = self._stepped(prompts, rows, messages, sampling)
        out = RolloutOutput([], [], [], [])
        for t in trajectories:
            out.token_ids.append(t.ids)
            out.logprobs.append(t.logprobs)
            out.finish_reasons.append(t.finish)
            out.sampled_masks.append(t.sampled)
        if not self.drives:  # each turn's tokens say which weights sampled them (observations: their turn's)
            out.token_versions = [t.versions for t in trajectories]
        return out, trajectories

    @property
    def drives(self) -> bool:
        """The environment runs its agent itself (an environment need not subclass Environment)."""
        return getattr(self.env, "drives", False)

    def release(self, states: list) -> None:
        """The rewards of these episodes are in (``Environment.release``)."""
        release = getattr(self.env, "release", None)
        if release is not None:
            release(states)

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if close is not None:
            close()

    def _driven(self, rows, messages, sampling: SamplingParams, train: bool) -> list[Trajectory]:
        """The episodes of an environment that runs its agent itself, checked: one group of n per row,
        or for a training call whole groups, at least one and at most one per row."""
        with stage_errors(self.env_name, "rollout"):
            late = train and "train" in inspect.signature(self.env.rollout).parameters  # it may hold groups
            trajectories = self.env.rollout(rows, messages, sampling, self, **({"train": True} if late else {}))
        count, n = len(trajectories), sampling.n
        if count != len(rows) * n and not (late and count % n == 0 and 0 < count < len(rows) * n):
            raise StageError(f"{self.env_name} returned {count} episodes for {len(rows)} rows x n={n}")
        return trajectories

    def _stepped(self, prompts, rows, messages, sampling: SamplingParams) -> list[Trajectory]:
        """Trajectories whose turns this loop generates and whose environment answers each turn."""
        n = sampling.n
        trajectories = []
        for i, (prompt, row, chat) in enumerate(zip(prompts, rows, messages)):
            for j in range(n):
                with stage_errors(self.env_name, "reset"):
                    state = self.env.reset(row, list(chat))
                trajectories.append(Trajectory(i * n + j, list(prompt), list(chat), state))
        base = sampling.model_copy(update={"n": 1, "seeds": None})
        seed = sampling.seed if sampling.seed is not None else 0
        ready, pending = list(trajectories), {}
        with cf.ThreadPoolExecutor(self.agent.workers, thread_name_prefix="hybridrl-env") as pool:
            while ready or pending:
                if ready:
                    for t in self._generate(ready, base, seed):
                        pending[pool.submit(self.env.step, t.state, t.last_text)] = t
                    ready = []
                if pending:
                    when = cf.FIRST_COMPLETED if self.eager else cf.ALL_COMPLETED
                    finished, _ = cf.wait(pending, return_when=when)
                    for future in sorted(finished, key=lambda f: pending[f].index):  # the same order every run
                        t = pending.pop(future)
                        if self._observe(t, future):
                            ready.append(t)
        return trajectories

    def _generate(self, live: list[Trajectory], base: SamplingParams, seed: int) -> list[Trajectory]:
        """One engine call for ``live``'s next turns; the trajectories that go on to their environment."""
        seeds = [seed + t.index + TURN_SEED_STRIDE * t.turns for t in live]
        out = self.session.generate([t.prompt + t.ids for t in live], base.model_copy(update={"seeds": seeds}))
        versions = out.token_versions or [[out.policy_version or 0] * len(ids) for ids in out.token_ids]
        stepping = []
        for t, ids, logprobs, finish, v in zip(live, out.token_ids, out.logprobs, out.finish_reasons, versions):
            room = self.budget - len(t.ids)
            if len(ids) > room:  # the trajectory's token budget ends inside this turn
                ids, logprobs, finish = ids[:room], logprobs[:room], "length"
            t.ids += ids
            t.logprobs += logprobs
            t.versions += v[: len(ids)]
            t.sampled += [1] * len(ids)
            t.turns += 1
            t.last_text = self.tokenizer.decode(ids, skip_special_tokens=True)
            t.messages.append({"role": "assistant", "content": t.last_text})
            if finish == "length":  # cut: no complete turn for the environment to answer
                t.done, t.finish = True, "length"
            else:
                stepping.append(t)
        return stepping

    def _observe(self, t: Trajectory, future) -> bool:
        """Apply an environment step's answer; whether the trajectory goes on to another turn."""
        try:
            obs: Observation = future.result()
        except Exception as e:
            raise StageError(f"{self.env_name} failed in step: {type(e).__name__}: {e}") from e
        t.info.update(obs.info)
        t.reward += obs.reward or 0.0
        if obs.done or not obs.messages or t.turns >= self.agent.max_turns:
            t.done = True
            return False
        last = t.ids[-1] if t.ids and t.ids[-1] in self.end_ids else None
        ids = observation_ids(self.tokenizer, obs.messages, self.tools, last)
        if len(t.ids) + len(ids) >= self.budget:  # no room for the observation and another turn
            t.done, t.finish = True, "length"
            return False
        t.ids += ids
        t.logprobs += [0.0] * len(ids)
        t.sampled += [0] * len(ids)
        t.versions += t.versions[-1:] * len(ids)  # not sampled: masked out of the versions' use
        t.messages += obs.messages
        t.info["observation_tokens"] += len(ids)
        return True


def build_agent(build, config, session, tokenizer, end_ids: set[int]) -> AgentLoop | None:
    """The agent loop of ``rollout.agent`` (None without one), generating through the engine
    ``session``; ``build(kind, name, options)`` builds a component as the trainer does."""
    a = config.rollout.agent
    if a is None:
        return None
    tools = {name: build("tool", name, a._tool_options[name]) for name in a.tools}
    env = build("environment", a.environment, a.options)
    env.tools, env.parser = tools, build("tool parser", a.parser, a._parser_options)
    eager = a.schedule == "eager" or (a.schedule == "auto" and session.seeds_each_request())
    schemas = [tool.schema() for tool in tools.values()] + list(getattr(env, "schemas", []))  # its own too
    return AgentLoop(session, env, a, config.rollout, tokenizer, end_ids, tools=schemas or None, eager=eager)
