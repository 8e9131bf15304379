"""The rollout stage: draw the step's prompts, and generate ``rollout.n`` responses to each."""

from __future__ import annotations

import torch

from hybridrl import distributed
from hybridrl import functional as F
from hybridrl.batch import Batch
from hybridrl.components import RolloutEngine, Sampling, SamplingParams
from hybridrl.errors import StageError, stage_errors
from hybridrl.memory import engine_memory_fix, memory_errors
from hybridrl.prompts import PromptOrder, encode_prompt, prompt_messages


def rollout_seed(seed: int, step: int, round_: int = 0, first_prompt: int = 0, n: int = 1) -> int:
    """The sampling seed of a call whose first prompt is the step's prompt ``first_prompt``.

    Engines that seed each request (vllm, sglang) give prompt i of a call ``seed + i·n`` and its
    sample j ``+ j``; with this rank's first prompt at ``first_prompt`` of the step, prompt p of
    the step (over all ranks) is seeded ``base + p·n``, so a run samples the same responses on
    any number of ranks. Rounds of a step draw other samples.
    """
    return seed * 100_003 + step + 10_000_019 * round_ + first_prompt * n


class RolloutStage:
    """The prompt source read in a seeded, resumable order, and the engine that answers it."""

    def __init__(self, engine: RolloutEngine, data, order: PromptOrder, tokenizer, config, agent=None):
        self.engine, self.data, self.order, self.tokenizer, self.config = engine, data, order, tokenizer, config
        self.agent = agent  # a hybridrl.agents.AgentLoop with rollout.agent: multi-turn trajectories
        self.tools = agent.tools if agent is not None else None
        self.component = f"rollout engine '{config.rollout.engine}'"

    def sampling(self, step: int, round_: int = 0) -> SamplingParams:
        """What the engine samples with: the rollout section of the config, and this round's seed."""
        r, t = self.config.rollout, self.config.trainer
        first = distributed.rank() * (t.prompts_per_step // distributed.world_size())
        seed = rollout_seed(t.seed, step, round_, first, r.n)
        return SamplingParams(**r.model_dump(include=set(Sampling.model_fields)), seed=seed)

    @torch.no_grad()
    def check_sync(self, step: int, policy_logprobs, first: bool = True, samples: int = 8) -> dict[str, float]:
        """After a weight sync, on every rank: the engine samples one token ``samples`` times for the
        first row's prompt, and its logprobs are compared with ``policy_logprobs(batch)`` (B, T); a
        mean difference above ``rollout.sync_check`` is an error naming the ranks. It runs after the
        ``first`` sync of a run and then every ``rollout.sync_check_every`` steps."""
        r = self.config.rollout
        due = first or (r.sync_check_every > 0 and step % r.sync_check_every == 0)
        if not r.sync_check or not due or not self.engine.holds_latest_weights():
            return {}
        tol = r.sync_check
        self.engine.wake_up()  # the next step's rollout needs it awake anyway
        ids, _ = encode_prompt(self.data[0], self.config.data, self.tokenizer, self.tools)
        keys = self.config.rollout.model_dump(include={"temperature", "top_p", "top_k"})
        sampling = SamplingParams(**keys, n=samples, max_tokens=1, seed=rollout_seed(self.config.trainer.seed, step, 7))
        with stage_errors(self.component, "generate (sync check)"):
            out = self.engine.generate([ids], sampling)
        probe = Batch.from_rollout([ids], out, samples, self.tokenizer.pad_token_id)
        lp = policy_logprobs(probe)
        diff = (lp - probe["rollout_logprobs"].to(lp.device)).abs()
        mean = float(F.masked_mean(diff, probe["response_mask"].to(lp.device)))
        means = distributed.all_gather_objects(mean)
        if max(means) > tol:
            ranks = [r for r, d in enumerate(means) if d > tol]
            raise StageError(
                f"{self.component} on rank(s) {ranks}: after the weight sync of step {step} its logprobs of a probe "
                f"prompt differ from the policy's by {max(means):.3g} on average (rollout.sync_check allows {tol:g}): "
                "the engine does not compute with the trainer's weights. A sync that did not reach it, or weights "
                "released by sleep() and never reloaded; set rollout.sync_check: 0 to skip this check."
            )
        return {"rollout/sync_check_diff_max": max(means)}

    def memory_errors(self, prompt_ids):
        """Out of memory while generating: an error naming the engine, the sizes and its memory options."""
        r = self.config.rollout
        sizes = (
            f"{len(prompt_ids)} prompts x {r.n} samples of up to {max(map(len, prompt_ids))} + {r.max_tokens} tokens"
        )
        device = getattr(getattr(self.engine, "ctx", None), "device", torch.device("cpu"))
        return memory_errors(f"{self.component} generate", device, sizes, engine_memory_fix(r.engine, len(prompt_ids)))

    def generate(self, step: int, round_: int = 0) -> Batch:
        """Draw ``trainer.prompts_per_step`` prompts, keep this rank's share, generate ``rollout.n``
        responses to each: the rollout batch, text columns included."""
        cfg, n = self.config, self.config.rollout.n
        # every rank draws the same prompts and keeps its slice: a prompt's n samples stay together
        rows = distributed.my_share([self.data[i] for i in self.order.take(cfg.trainer.prompts_per_step)])
        prompt_ids, prompt_texts = zip(*(encode_prompt(row, cfg.data, self.tokenizer, self.tools) for row in rows))
        chats = [prompt_messages(row, cfg.data) for row in rows]
        if self.agent is not None:
            out, trajectories = self.agent.run(list(prompt_ids), rows, chats, self.sampling(step, round_))
        else:
            with stage_errors(self.component, "generate"), self.memory_errors(prompt_ids):
                out = self.engine.generate(list(prompt_ids), self.sampling(step, round_))
        rollout = Batch.from_rollout(list(prompt_ids), out, n, self.tokenizer.pad_token_id)
        first = (round_ * distributed.world_size() + distributed.rank()) * len(rows)  # unique over ranks and rounds
        rollout["group_ids"] = rollout["group_ids"] + first
        rollout["prompt_text"] = [prompt_texts[i // n] for i in range(len(rollout))]
        col = cfg.data.answer_column
        rollout["answer"] = [rows[i // n].get(col) if col else None for i in range(len(rollout))]
        rollout["metadata"] = [rows[i // n].get("metadata") for i in range(len(rollout))]
        rollout["messages"] = [chats[i // n] for i in range(len(rollout))]
        if self.agent is None:
            rollout["response_text"] = self.tokenizer.batch_decode(out.token_ids, skip_special_tokens=True)
            return rollout
        # rewards read the final answer; the whole exchange is there for those that want it
        rollout["response_text"] = [t.last_text for t in trajectories]
        rollout["trajectory"] = [t.messages[len(chats[i // n]) :] for i, t in enumerate(trajectories)]
        rollout["env_reward"] = [t.reward for t in trajectories]
        rollout["turns"] = [t.turns for t in trajectories]
        for key in ("tool_calls", "tool_errors", "observation_tokens"):
            rollout[key] = [t.info[key] for t in trajectories]
        return rollout
