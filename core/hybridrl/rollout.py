"""The rollout stage: draw the step's prompts, and generate ``rollout.n`` responses to each
through the run's engine session (:mod:`hybridrl.session`)."""

from __future__ import annotations

import functools

import torch

from hybridrl import distributed
from hybridrl.batch import Batch
from hybridrl.components import SamplingParams
from hybridrl.prompts import PromptOrder, encode_prompt, prompt_messages, row_answer
from hybridrl.session import EngineSession


class RolloutStage:
    """The prompt source read in a seeded, resumable order, and the engine session that answers it."""

    def __init__(self, session: EngineSession, data, order: PromptOrder, tokenizer, config, agent=None):
        self.session, self.data, self.order, self.tokenizer, self.config = session, data, order, tokenizer, config
        self.agent = agent  # a hybridrl.agents.AgentLoop with rollout.agent: multi-turn trajectories
        self.tools = agent.tools if agent is not None else None

    @functools.cached_property
    def probe_prompt(self) -> list[int]:
        """The sync check's prompt: the prompt source's first row, encoded once."""
        return encode_prompt(self.data[0], self.config.data, self.tokenizer, self.tools)[0]

    def generate(self, step: int, round_: int = 0) -> Batch:
        """Draw ``trainer.prompts_per_step`` prompts, keep this rank's share, generate ``rollout.n``
        responses to each: the rollout batch, text columns included."""
        # every rank draws the same prompts and keeps its slice: a prompt's n samples stay together
        rows = distributed.my_share([self.data[i] for i in self.order.take(self.config.trainer.prompts_per_step)])
        rollout = self.respond(rows, self.session.sampling(step, round_), train=True)
        first = (round_ * distributed.world_size() + distributed.rank()) * len(rows)  # unique over ranks and rounds
        rollout["group_ids"] = rollout["group_ids"] + first
        return rollout

    def respond(self, rows: list[dict], sampling: SamplingParams, train: bool = False) -> Batch:
        """``sampling.n`` responses to each of ``rows`` (prompts built by the config's data section):
        the batch, text columns included, groups numbered from 0. Evaluation answers its sets so too;
        a training call (``train``) may be answered with groups of earlier rows (late rewards)."""
        cfg, n = self.config, sampling.n
        prompt_ids, prompt_texts = self.encode(rows)
        if self.agent is None:
            return self.answered(rows, prompt_ids, prompt_texts, self.session.generate(prompt_ids, sampling), n)
        chats = [prompt_messages(row, cfg.data) for row in rows]
        # each trajectory has its prompt (an agent harness writes its own)
        out, trajectories = self.agent.run(list(prompt_ids), rows, chats, sampling, train)
        if any(t.row is not None for t in trajectories):  # groups an environment held for their rewards
            rows = [t.row if t.row is not None else rows[t.index // n] for t in trajectories[::n]]
            prompt_texts = [encode_prompt(row, cfg.data, self.tokenizer, self.tools)[1] for row in rows]
            chats = [prompt_messages(row, cfg.data) for row in rows]
        rollout = Batch.from_rollout([t.prompt for t in trajectories], out, 1, self.pad_id)
        rollout["group_ids"] = torch.arange(len(rollout)) // n
        rollout = self.assemble(rows, prompt_texts, rollout, n)
        # rewards read the final answer; the whole exchange is there for those that want it
        rollout["response_text"] = [t.last_text for t in trajectories]
        drives = self.agent.drives  # an agent harness's messages are its own, not the prompt's
        rollout["trajectory"] = [t.messages[0 if drives else len(chats[i // n]) :] for i, t in enumerate(trajectories)]
        rollout["env_reward"] = [t.reward for t in trajectories]
        rollout["turns"] = [t.turns for t in trajectories]
        rollout["agent_info"] = [dict(t.info) for t in trajectories]  # counts, logged as agent/<key>_mean
        if drives:
            rollout["episode"] = [t.state for t in trajectories]
            rollout["branches"] = [t.branches for t in trajectories]  # rows of their own when trained
        return rollout

    def release(self, rollout: Batch) -> None:
        """A training call's batch is scored (or dropped): its episodes' environment may let go of what
        it kept for their rewards."""
        if "episode" in rollout:
            self.agent.release(rollout["episode"])

    def encode(self, rows: list[dict]) -> tuple[list[list[int]], list[str]]:
        """The prompts of ``rows`` as the config's data section builds them: their ids and texts."""
        encoded = [encode_prompt(row, self.config.data, self.tokenizer, self.tools) for row in rows]
        return [ids for ids, _ in encoded], [text for _, text in encoded]

    def answered(self, rows, prompt_ids, prompt_texts, out, n: int) -> Batch:
        """The batch of the engine's answer ``out`` (``n`` responses a prompt) to single-turn ``rows``."""
        rollout = self.assemble(rows, prompt_texts, Batch.from_rollout(prompt_ids, out, n, self.pad_id), n)
        rollout["response_text"] = self.tokenizer.batch_decode(out.token_ids, skip_special_tokens=True)
        return rollout

    def assemble(self, rows: list[dict], prompt_texts: list[str], rollout: Batch, n: int) -> Batch:
        """``rollout`` (``n`` rows a prompt of ``rows``) with the columns rewards read of each row's prompt."""
        answers = [row_answer(row, self.config.data) for row in rows]
        for key, values in (
            ("prompt_text", prompt_texts),
            ("answer", answers),
            ("metadata", [row.get("metadata") for row in rows]),
            ("row", rows),  # every field, for rewards that want them
            ("messages", [prompt_messages(row, self.config.data) for row in rows]),
        ):
            rollout[key] = [values[i // n] for i in range(len(rollout))]
        return rollout

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id
