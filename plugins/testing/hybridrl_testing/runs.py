"""Run configs that several test modules share."""

from __future__ import annotations


def checkpointed_run(model, run_dir, **trainer) -> dict:
    """A two-step GRPO run of ``model`` on the hf engine that saves a checkpoint every step (``trainer``: overrides)."""
    return {
        "model": {"path": model},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 32},
        "rollout": {"engine": "hf", "n": 2, "max_tokens": 4},
        "rewards": [{"function": "format", "pattern": "7"}],
        "algorithm": {"name": "grpo"},
        "trainer": {"steps": 2, "save_every": 1, "keep_last": 3, "prompts_per_step": 2, "seed": 0, "threads": 1}
        | {"run_dir": str(run_dir), **trainer},
        "logging": {"loggers": ["jsonl"]},
    }
