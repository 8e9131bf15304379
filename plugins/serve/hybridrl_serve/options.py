"""What ``hybridrl serve`` adds to a run config: its ``online`` section and the ``user_rating`` reward."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from hybridrl.components import Options, RewardFunction


class OnlineOptions(Options):
    """``hybridrl serve``: answer users with the policy, learn from their ratings (docs/online.md)."""

    update_every: int = Field(16, gt=0, description="Run an update once this many new ratings are in.")
    update_every_s: float = Field(
        0, ge=0, description="Also run one when the oldest untrained rating is this many seconds old; 0: off."
    )
    max_batch: int = Field(256, gt=0, description="Most ratings one update trains on (the oldest first).")
    baseline: Literal["auto", "leave_one_out", "running"] = Field(
        "auto",
        description="Advantage = rating - baseline. leave_one_out: the mean rating of the other answers to the same "
        "prompt in the update; running: the mean of all earlier ratings; auto: leave_one_out where the update "
        "has another answer to the prompt, running otherwise.",
    )
    rating_min: float = Field(0.0, description="Lowest rating accepted; 'down' (thumbs down) stores it.")
    rating_max: float = Field(1.0, description="Highest rating accepted; 'up' (thumbs up) stores it.")
    batch_requests: int = Field(
        16, gt=0, description="Requests that wait while the engine is busy are answered together, up to this many."
    )
    tool_parser: str = Field(
        "hermes",
        description="Tool-call parser plugin that reads the calls in answers to requests with 'tools' (the format "
        "the chat template teaches, as rollout.agent.parser).",
    )
    max_request_bytes: int = Field(65536, gt=0, description="Larger request bodies get 413.")
    requests_per_minute: int = Field(120, gt=0, description="Per client address; more get 429.")
    save_every: int = Field(1, gt=0, description="Checkpoint every this many updates (the last one always).")

    @field_validator("rating_max")
    @classmethod
    def _above_min(cls, value, info):
        low = info.data.get("rating_min")
        if low is not None and not low < value:
            raise ValueError(f"must be above online.rating_min={low}")
        return value


class UserRating(RewardFunction):
    """The rating a user gave the answer (``hybridrl serve``: ``batch["rating"]``, docs/online.md)."""

    def score(self, batch):
        if "rating" not in batch:
            raise ValueError("reward function 'user_rating' scores users' ratings: it works under 'hybridrl serve'.")
        return batch["rating"]
