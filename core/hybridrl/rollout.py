"""The rollout stage: draw the step's prompts, and generate ``rollout.n`` responses to each."""

from __future__ import annotations

from hybridrl import distributed
from hybridrl.batch import Batch
from hybridrl.components import RolloutEngine, Sampling, SamplingParams
from hybridrl.errors import stage_errors
from hybridrl.prompts import PromptOrder, encode_prompt, prompt_messages


def rollout_seed(seed: int, step: int, round_: int = 0) -> int:
    """The sampling seed of a step's round on this rank: ranks and rounds never draw the same samples."""
    return seed * 100_003 + step + 1_000_003 * distributed.rank() + 10_000_019 * round_


class RolloutStage:
    """The prompt source read in a seeded, resumable order, and the engine that answers it."""

    def __init__(self, engine: RolloutEngine, data, order: PromptOrder, tokenizer, config):
        self.engine, self.data, self.order, self.tokenizer, self.config = engine, data, order, tokenizer, config
        self.component = f"rollout engine '{config.rollout.engine}'"

    def sampling(self, step: int, round_: int = 0) -> SamplingParams:
        """What the engine samples with: the rollout section of the config, and this round's seed."""
        keys = self.config.rollout.model_dump(include=set(Sampling.model_fields))
        return SamplingParams(**keys, seed=rollout_seed(self.config.trainer.seed, step, round_))

    def generate(self, step: int, round_: int = 0) -> Batch:
        """Draw ``trainer.prompts_per_step`` prompts, keep this rank's share, generate ``rollout.n``
        responses to each: the rollout batch, text columns included."""
        cfg, n = self.config, self.config.rollout.n
        # every rank draws the same prompts and keeps its slice: a prompt's n samples stay together
        rows = distributed.my_share([self.data[i] for i in self.order.take(cfg.trainer.prompts_per_step)])
        prompt_ids, prompt_texts = zip(*(encode_prompt(row, cfg.data, self.tokenizer) for row in rows))
        with stage_errors(self.component, "generate"):
            out = self.engine.generate(list(prompt_ids), self.sampling(step, round_))
        rollout = Batch.from_rollout(list(prompt_ids), out, n, self.tokenizer.pad_token_id)
        first = (round_ * distributed.world_size() + distributed.rank()) * len(rows)  # unique over ranks and rounds
        rollout["group_ids"] = rollout["group_ids"] + first
        rollout["prompt_text"] = [prompt_texts[i // n] for i in range(len(rollout))]
        rollout["response_text"] = self.tokenizer.batch_decode(out.token_ids, skip_special_tokens=True)
        col = cfg.data.answer_column
        rollout["answer"] = [rows[i // n].get(col) if col else None for i in range(len(rollout))]
        rollout["metadata"] = [rows[i // n].get("metadata") for i in range(len(rollout))]
        rollout["messages"] = [prompt_messages(rows[i // n], cfg.data) for i in range(len(rollout))]
        return rollout
