"""The run config's ``tinker`` section: what ``hybridrl tinker`` adds (docs/tinker.md)."""

from __future__ import annotations

from pydantic import Field

from hybridrl.components import Options


class TinkerOptions(Options):
    """``hybridrl tinker``: serve the Tinker training API over the run's model (docs/tinker.md)."""

    model_names: list[str] = Field(
        default_factory=list,
        description="Names clients may send as base_model for the run's model.path, beside its own name (a hub "
        "name the client's recipes know, e.g. Qwen/Qwen3-4B-Instruct-2507, for a local folder).",
    )
    max_models: int = Field(8, gt=0, description="Training clients (LoRA adapters over the one base) held at once.")
    sampler_snapshots: int = Field(
        4,
        gt=0,
        description="Unnamed sampler weights (save_weights_and_get_sampling_client) kept per model; older ones expire.",
    )
    max_request_bytes: int = Field(256 * 2**20, gt=0, description="Larger request bodies get 413.")
    poll_s: float = Field(20.0, gt=0, lt=45, description="How long retrieve_future holds a poll for a result.")
