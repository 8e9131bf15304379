"""Episodes: what an agent's calls to the gateway sampled, kept as token-exact trajectories.

Each call's messages are compared with the calls the episode made before. When they extend one of
them (its messages, then the assistant message the gateway answered, then new messages: tool
results, a user's reply), the call continues that trajectory: its prompt is the trajectory's ids
(the first prompt, the sampled turns, the observations between them) followed by the new messages
as the chat template frames them after a sampled turn (:func:`hybridrl.agents.observation_ids`),
tokenised once. The sampled text is never tokenised again, so the ids trained on are the ids
sampled. A call whose messages do not extend any earlier one (the harness cut, summarised or
rewrote its history) starts a new branch from its own rendered messages: a fork, counted.

The trajectories trained (:meth:`Episode.trained`) are the branch of the last call and, by default,
every earlier branch: the trajectory of each earlier call that no later call continued.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from hybridrl.agents import observation_ids


def comparable(m: dict) -> dict:
    """What of a message must be the same for a call to continue an earlier one: not the ids of
    tool calls (the harness's bookkeeping), nor the whitespace around an answer's text (smolagents
    and others trim it; the trajectory keeps the sampled ids), the rest as sent."""
    out = {k: v for k, v in m.items() if k not in ("tool_call_id", "tool_calls")}
    if m.get("role") == "assistant" and isinstance(m.get("content"), str):
        out["content"] = m["content"].strip()
    if m.get("tool_calls"):
        out["tool_calls"] = [c["function"] for c in m["tool_calls"]]
    return out


def same(a: dict, b: dict) -> bool:
    return comparable(a) == comparable(b)


@dataclass
class Turn:
    """One answer of one call: the call's messages and tools, the reply the gateway sent, and the
    trajectory up to and including that reply."""

    messages: list[dict]
    tools: list[dict] | None
    reply: dict  # the assistant message answered
    prompt: list[int]  # the branch's prompt: its first call's rendered messages
    ids: list[int]  # the response so far: sampled turns (sampled 1) and observations (sampled 0)
    logprobs: list[float]
    sampled: list[int]
    version: int  # the policy version that sampled this reply
    text: str  # the reply's text as answered
    finish: str  # its finish reason: stop, length, tool_calls
    parent: Turn | None = None  # the turn its call continued (None: the first of a branch)
    call: int = 0  # the episode's call that answered it, from 0
    continued: bool = False  # a later call continued it

    @property
    def path(self) -> list[Turn]:
        """The turns of its trajectory: its parent's, then itself."""
        return ([] if self.parent is None else self.parent.path) + [self]


@dataclass
class Context:
    """Where a call's answer starts: the branch's prompt and its response so far."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    forked: bool = False
    parent: Turn | None = None  # the turn it continues

    @property
    def engine_prompt(self) -> list[int]:
        return self.prompt + self.ids


class Episode:
    """The calls of one agent run: its turns (every answer, every branch), calls, forks, and the
    reward posted for it. One lock per episode: its calls are answered one after another."""

    def __init__(self, episode_id: str, index: int = 0, row: dict | None = None):
        self.id, self.index, self.row = episode_id, index, row  # index: its place among the call's episodes
        self.seed = index  # its calls' seeds start here
        self.turns: list[Turn] = []
        self.calls = self.forks = self.tool_calls = self.malformed = self.unforced = 0
        self.sampled_tokens = 0  # of every answer, every branch: those off the trained branch are not trained
        self.closed = False
        self.sampling = None  # what its calls sample with beside their seeds (SamplingParams)
        self.reward: float | None = None
        self.final: Turn | None = None  # the last call's (first) answer: the trajectory trained on
        self.lock = threading.Lock()

    def context(self, messages: list[dict], tools: list[dict] | None, tokenizer, end_ids: set[int]) -> Context:
        """Where an answer to ``messages`` starts: continuing the latest turn they extend, else a
        new branch rendered from them (a fork, when the episode has answered before)."""
        for turn in reversed(self.turns):
            k = len(turn.messages)
            if (
                turn.tools == tools
                and len(messages) > k
                and all(same(a, b) for a, b in zip(messages[:k], turn.messages))
                and same(messages[k], turn.reply)
            ):
                last = turn.ids[-1] if turn.ids and turn.ids[-1] in end_ids and turn.sampled[-1] else None
                obs = observation_ids(tokenizer, messages[k + 1 :], tools, last)
                return Context(
                    turn.prompt,
                    turn.ids + obs,
                    turn.logprobs + [0.0] * len(obs),
                    turn.sampled + [0] * len(obs),
                    parent=turn,
                )
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        return Context(tokenizer(text, add_special_tokens=False)["input_ids"], forked=bool(self.turns))

    def record(self, ctx: Context, turns: list[Turn]) -> None:
        """A call's answers to ``ctx``: its first answer is the episode's latest trajectory."""
        for turn in turns:
            turn.parent, turn.call = ctx.parent, self.calls - 1
        if ctx.parent is not None:
            ctx.parent.continued = True
        self.turns += turns
        self.sampled_tokens += sum(len(turn.ids) - len(ctx.ids) for turn in turns)
        self.final = turns[0]
        self.forks += ctx.forked

    def trained(self, branches: bool = True) -> list[Turn]:
        """The turns whose trajectories train: the last call's first answer, then (``branches``)
        the first answer of each earlier call of which no answer was continued, in call order."""
        if self.final is None:
            return []
        ends = [self.final]
        if branches:
            calls: dict[int, list[Turn]] = {}
            for turn in self.turns:
                calls.setdefault(turn.call, []).append(turn)
            ends += [ts[0] for c, ts in calls.items() if c != self.final.call and not any(t.continued for t in ts)]
        return ends

    def untrained_tokens(self, trained: list[Turn]) -> int:
        """Tokens sampled (every answer, every branch) on none of the ``trained`` trajectories."""
        on_path = {id(t): t for end in trained for t in end.path}
        return self.sampled_tokens - sum(t.sampled.count(1) - (t.parent.sampled.count(1) if t.parent else 0)
                                         for t in on_path.values())  # fmt: skip
