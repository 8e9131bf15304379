"""Every tenant's rollouts of a step in one engine call, each prompt answered by its tenant's adapter.

Where the run syncs adapters alone (``model.lora.sync``), the engine session holds each tenant's latest
adapter by name, and a call names the adapter of each prompt (``SamplingParams.adapters``). The first
tenant's step draws every tenant's prompts and asks for all of them at once; each tenant's step then
takes its own answers. A tenant's answers come from its adapter as its step starts (the tenants before
it in the step change only their own), so a step trains on exactly what it would have sampled on its
own, and each prompt keeps the seed it would have had in a call of its own tenant's: the same samples.
An engine that mixes adapters in a batch (vLLM) answers in one batch; the session gives one that holds
one adapter at a time (hf) a call per tenant in turn, loading each adapter.
"""

from __future__ import annotations

from hybridrl import distributed
from hybridrl.batch import Batch, RolloutOutput
from hybridrl.rollout import RolloutStage


class Together:
    """The step's rollouts of every tenant (its :class:`TenantRollout`), made at the first that asks."""

    def __init__(self, session):
        self.session, self.stages, self.ready = session, {}, {}

    def take(self, name: str, step: int) -> Batch:
        if (name, step) not in self.ready:
            self.ready = self.generate(step)
        return self.ready.pop((name, step))

    def generate(self, step: int) -> dict[tuple[str, int], Batch]:
        sampling = self.session.sampling(step)
        drawn, prompts, names, seeds = [], [], [], []
        for name, stage in self.stages.items():
            take = stage.order.take(stage.config.trainer.prompts_per_step)
            rows = distributed.my_share([stage.data[i] for i in take])  # as RolloutStage.generate draws them
            ids, texts = stage.encode(rows)
            drawn.append((name, stage, rows, ids, texts))
            prompts, names, seeds = prompts + ids, names + [name] * len(ids), seeds + sampling.prompt_seeds(len(ids))
        out = self.session.generate(prompts, sampling.model_copy(update={"seeds": seeds, "adapters": names}))
        ready, first, n = {}, 0, sampling.n
        for name, stage, rows, ids, texts in drawn:
            rollout = stage.answered(rows, ids, texts, part(out, first * n, (first + len(ids)) * n), n)
            rollout["group_ids"] = rollout["group_ids"] + distributed.rank() * len(rows)
            ready[(name, step)] = rollout
            first += len(ids)
        return ready


class TenantRollout(RolloutStage):
    """A tenant's rollout stage: a step's first round comes from the call for every tenant (:class:`Together`);
    refill rounds (rollout.refill_rounds), which only this tenant may need, are its own calls."""

    def __init__(self, together: Together, name: str, *stage):
        super().__init__(*stage)
        self.together, self.name = together, name
        together.stages[name] = self

    def generate(self, step: int, round_: int = 0) -> Batch:
        return super().generate(step, round_) if round_ else self.together.take(self.name, step)


def part(out: RolloutOutput, start: int, stop: int) -> RolloutOutput:
    """Rows ``start`` to ``stop`` of an engine's answer."""
    cut = lambda rows: None if rows is None else rows[start:stop]  # noqa: E731
    return RolloutOutput(
        cut(out.token_ids), cut(out.logprobs), cut(out.finish_reasons), cut(out.sampled_masks),
        out.policy_version, cut(out.token_versions),
    )  # fmt: skip
