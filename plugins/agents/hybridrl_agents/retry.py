"""The ``retry`` environment: feedback on a wrong answer and another try (examples/agent_retry_smollm2.yaml)."""

from __future__ import annotations

from pydantic import Field

from hybridrl import plugins
from hybridrl.batch import Batch
from hybridrl.components import Environment, Observation, Options


class RetryEnvironment(Environment):
    """Checks each answer with a reward function and, while it is wrong, says so and lets the model
    try again (up to ``rollout.agent.max_turns`` answers); a right answer ends the trajectory."""

    class Options(Options):
        check: str = Field("reasoning_gym", description="Reward function that scores an answer (1 = right).")
        check_options: dict = Field(default_factory=dict, description="Options of that reward function.")
        threshold: float = Field(1.0, description="A score at least this is a right answer.")
        feedback: str = Field("That is not right. Try again.", description="The user's reply to a wrong answer.")

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        cls = plugins.lookup("reward function", options.check)
        self.checker = cls(cls.Options.model_validate(options.check_options), ctx)

    def reset(self, row: dict, messages: list[dict]) -> dict:
        return {"row": row, "messages": messages}

    def step(self, state, turn: str) -> Observation:
        row = state["row"]
        batch = Batch()
        batch["prompt_text"] = [""]
        batch["response_text"] = [turn]
        batch["answer"] = [row.get("answer")]
        batch["metadata"] = [row.get("metadata")]
        batch["messages"] = [state["messages"]]
        score = float(list(self.checker.score(batch))[0])
        if score >= self.options.threshold:
            return Observation(done=True, info={"right": 1})
        return Observation([{"role": "user", "content": self.options.feedback}], info={"retries": 1})
