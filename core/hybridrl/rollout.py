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


SYNC_CHECK_FACTOR = 20  # after syncs, allow this many times the difference measured before the first


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
    def probe(self, step: int, policy_logprobs, samples: int = 8) -> float:
        """The engine samples one token ``samples`` times for the first row's prompt; returns the
        largest, over ranks, mean |engine logprob - ``policy_logprobs(batch)``| of those tokens."""
        self.engine.wake_up()  # the next step's rollout needs it awake anyway
        ids, _ = encode_prompt(self.data[0], self.config.data, self.tokenizer, self.tools)
        keys = self.config.rollout.model_dump(include={"temperature", "top_p", "top_k"})
        sampling = SamplingParams(**keys, n=samples, max_tokens=1, seed=rollout_seed(self.config.trainer.seed, step, 7))
        with stage_errors(self.component, "generate (sync check)"):
            out = self.engine.generate([ids], sampling)
        batch = Batch.from_rollout([ids], out, samples, self.tokenizer.pad_token_id)
        lp = policy_logprobs(batch)
        diff = (lp - batch["rollout_logprobs"].to(lp.device)).abs()
        self._means = distributed.all_gather_objects(float(F.masked_mean(diff, batch["response_mask"].to(lp.device))))
        return max(self._means)

    def check_start(self, step: int, policy_logprobs, resumed: bool, sync) -> tuple[dict[str, float], str | None]:
        """Before the run's first update, when the engine should hold the policy's own weights: the
        difference the engine's precision and conventions give (the baseline), the metrics, and an
        error message when it is above ``rollout.sync_check``. An engine that started from other
        weights (a server left by another run) is sent the policy's (``sync()``) and probed again.
        Later checks allow ``max(rollout.sync_check, SYNC_CHECK_FACTOR x baseline)``."""
        r = self.config.rollout
        if not r.sync_check or not self.engine.holds_latest_weights():
            return {}, None
        base = first = self.probe(step, policy_logprobs)
        if first > r.sync_check and not resumed:  # resumed: the engine took the checkpoint's weights already
            sync()
            base = self.probe(step, policy_logprobs)
        self.allowed = max(r.sync_check, SYNC_CHECK_FACTOR * base)
        metrics = {"rollout/sync_check_start": first, "rollout/sync_check_baseline": base}
        metrics["rollout/sync_check_allowed"] = self.allowed
        if base <= r.sync_check:
            return metrics, None
        if resumed:
            return metrics, self._sync_error(step, base, r.sync_check, "at resume")
        ranks = [i for i, d in enumerate(self._means) if d > r.sync_check]
        return metrics, (
            f"{self.component} on rank(s) {ranks}: before the first update, holding the policy's own weights (as "
            f"loaded, and sent once more), its logprobs of a probe prompt differ from the policy's by {base:.3g} on "
            f"average (rollout.sync_check allows {r.sync_check:g}). The weights are the same on both sides: the "
            "engine computes logprobs another way than the trainer, which scores each sampled token at its own "
            "position under softmax(logits / temperature) over the whole vocabulary, in the policy's precision. "
            "Check the engine's logprobs (temperature applied, no offset, not truncated), its dtype, or the model's "
            "support in the engine (or, for a server, that it takes weights at all); for an engine of lower "
            "precision raise rollout.sync_check. Step 1's metrics are in metrics.jsonl."
        )

    def check_sync(self, step: int, policy_logprobs, first: bool = True) -> dict[str, float]:
        """After a weight sync: the probe of :meth:`probe`, whose difference above the allowed one
        (see :meth:`check_start`) is an error naming the ranks. It runs after the ``first`` sync of
        a run and then every ``rollout.sync_check_every`` steps."""
        r = self.config.rollout
        due = first or (r.sync_check_every > 0 and step % r.sync_check_every == 0)
        if not r.sync_check or not due or not self.engine.holds_latest_weights():
            return {}
        tol = getattr(self, "allowed", r.sync_check)
        worst = self.probe(step, policy_logprobs)
        if worst > tol:
            raise StageError(self._sync_error(step, worst, tol, f"after the weight sync of step {step}"))
        return {"rollout/sync_check_diff_max": worst}

    def _sync_error(self, step: int, worst: float, tol: float, when: str) -> str:
        ranks = [i for i, d in enumerate(self._means) if d > tol]
        return (
            f"{self.component} on rank(s) {ranks}: {when} its logprobs of a probe prompt differ from the policy's by "
            f"{worst:.3g} on average (allowed: {tol:.3g}, from rollout.sync_check and the difference before the first "
            "sync): the engine does not compute with the trainer's weights. A sync that did not reach it, weights "
            "released by sleep() and never reloaded, or tensors it loads under other names or layouts; set "
            "rollout.sync_check: 0 to skip this check."
        )

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
