"""The run's context, which every component is built with (:class:`RunContext`), and what it
carries: the pass runner's protocol and what training keeps in memory. Part of the plugin contract
(:mod:`hybridrl.components` re-exports it)."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridrl.batch import Batch
from hybridrl.sampling import Sampling


@dataclass(frozen=True)
class TrainingMemory:
    """What training keeps on each GPU of the run (bytes per rank), for an engine that shares it: the
    trained parameters' float32 weights and AdamW's two moments between updates, and their gradients
    beside them while it updates, plus a frozen base (LoRA's) at ``frozen_bytes`` a parameter, over the
    ranks (estimates from the parameter counts)."""

    parameters: int  # the policy's parameters, LoRA's adapters included
    trained: int  # of them, those the optimizer steps (LoRA: the adapters alone)
    between_updates: int  # 12 bytes a trained parameter, and the frozen ones', over the ranks
    during_update: int  # 16 bytes a trained parameter, and the frozen ones', over the ranks

    @classmethod
    def of(cls, parameters: int, world_size: int, adapters: int = 0, frozen_bytes: float = 4) -> TrainingMemory:
        """``adapters``: LoRA's parameters over ``parameters`` frozen ones; 0: every parameter trains."""
        trained, frozen = (adapters, int(parameters * frozen_bytes)) if adapters else (parameters, 0)
        return cls(
            parameters + adapters, trained, (trained * 12 + frozen) // world_size, (trained * 16 + frozen) // world_size
        )


class PassRunner(typing.Protocol):
    """What components use of the trainer's pass runner (:class:`hybridrl.passes.Runner`): every
    forward pass of a run goes through it, cut and laid out (padded, shared prompts, packed) by
    its planner. A critic registers with ``handle(model, values=True)`` and computes its values."""

    def handle(self, model: torch.nn.Module, values: bool = False) -> Any: ...

    def values(self, model: torch.nn.Module, batch: Batch, component: str, size: int | None = None) -> torch.Tensor:
        """(B, T) values of a value model before each response token, without gradients, in passes."""

    def pass_values(self, model: torch.nn.Module, part: Batch, component: str = "critic") -> torch.Tensor:
        """(b, T) values over the rows of one pass of the update, with gradients."""


@dataclass(frozen=True)
class RunContext:
    """What every component may need to know about the run it is part of; read-only.

    One object per run, built before any component (:func:`hybridrl.run.build_run`), never
    replaced: every component of the run holds the same one. What the run learns while it builds
    joins it in place, in this order: ``prompt_tokens`` once the prompt sources are read, then
    ``strategy`` and ``passes`` once built. Read them when they are needed, not only in
    ``__init__``: while they are built, the training prompt source sees all three None, the
    strategy ``strategy`` and ``passes`` None; every other component sees them set.
    """

    model_path: str  # a plain Hugging Face model folder (GGUF files are converted first)
    tokenizer: Any  # the policy's transformers tokenizer
    device: torch.device  # the device of the policy on this process
    dtype: torch.dtype  # the policy's parameter dtype
    seed: int
    run_dir: Path
    rank: int = 0  # this process's rank under torchrun (0 on one process)
    world_size: int = 1  # processes in the run; each trains on its share of the step's prompts
    strategy: Any = None  # the run's sharding strategy (hybridrl.components.ShardingStrategy), to wrap extra models
    local_rank: int = 0  # the rank within its node: the GPU index under torchrun
    trust_remote_code: bool = False  # model.trust_remote_code: engines load the policy's code with it
    dropout: bool = False  # model.dropout: keep dropout active in the models that train
    response_tokens: int | None = None  # the longest response of the run (rollout.max_tokens)
    prompt_tokens: int | None = None  # the longest prompt of the data (its first 256 rows), for engines' buffers
    steps: int | None = None  # the run's RL steps (trainer.steps); None: no planned end
    sampling: Sampling | None = None  # what the run's rollouts sample with (the rollout section's sampling keys)
    responses_per_call: int | None = None  # the most responses one generate call of this rank asks for; None: any
    passes: PassRunner | None = None  # the trainer's pass runner: a critic's passes run (and pack) through it
    training_memory: TrainingMemory | None = None  # what training keeps on a GPU beside an engine; None: CPU, eval
    lora: Any = None  # a training run's model.lora (r, target_modules, sync): engines that take adapters prepare

    @property
    def is_main(self) -> bool:
        """Whether this process writes the run's files and prints (rank 0)."""
        return self.rank == 0

    def join(self, **parts) -> None:
        """The run's builder alone: set fields the run has just learned (each once, while None)."""
        for name, value in parts.items():
            if getattr(self, name) is not None:
                raise RuntimeError(f"RunContext.{name} is set once, by the run's builder")
            object.__setattr__(self, name, value)
