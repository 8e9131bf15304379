"""Prompt sources: Hugging Face ``datasets`` (local files or a hub name) and reasoning-gym."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field

from hybridrl.components import INPUT_PATH, Options, PromptSource
from hybridrl.errors import ConfigError
from hybridrl.hookspecs import hookimpl


def require_reasoning_gym():
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError(
            "The reasoning_gym prompt source and reward need the reasoning-gym package: pip install 'hybridrl[tasks]'"
        ) from None
    return reasoning_gym


FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


class HFDataset(PromptSource):
    """Rows of a ``datasets`` dataset: ``path: json`` with ``data_files``, or a hub name in the cache."""

    class Options(Options):
        path: str = Field(
            description="datasets.load_dataset path: 'json', 'parquet', 'csv' (with data_files), a single "
            ".json/.jsonl/.parquet/.csv file, a local dataset folder, or a hub name already in the local cache.",
            json_schema_extra=INPUT_PATH,
        )
        data_files: str | list[str] | dict[str, Any] | None = Field(
            None, description="Files for json/parquet/csv.", json_schema_extra=INPUT_PATH
        )
        name: str | None = Field(None, description="Dataset configuration name.")
        split: str = "train"
        limit: int | None = Field(None, gt=0, description="Use only the first N rows.")

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        import datasets

        o = options
        try:
            path, files = o.path, o.data_files
            builder = FILE_BUILDERS.get(Path(path).suffix.lower())
            if builder and files is None and Path(path).is_file():  # path: a single local file
                path, files = builder, path
            ds = datasets.load_dataset(path, o.name, data_files=files, split=o.split)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"data: could not load dataset '{o.path}' (data_files={o.data_files}): {e}") from e
        except StopIteration:  # datasets' builders look at the first rows to infer the columns
            raise ConfigError(
                f"data: the prompt source 'hf' yields no prompts: '{o.path}' (data_files={o.data_files}) has no rows."
            ) from None
        self.ds = ds.select(range(min(o.limit, len(ds)))) if o.limit else ds

    @property
    def columns(self) -> list[str]:
        return list(self.ds.column_names)

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, index):
        return self.ds[index]


class ReasoningGym(PromptSource):
    """Procedurally generated tasks with verifiable answers from the reasoning-gym package."""

    class Options(Options):
        task: str = Field(description="reasoning-gym dataset name, e.g. chain_sum, basic_arithmetic.")
        size: int = Field(1000, gt=0, description="Number of generated problems.")
        seed: int = Field(0, description="Generator seed (independent of the trainer seed).")
        config: dict[str, Any] = Field(
            default_factory=dict, description="Task options, e.g. {min_terms: 2, max_terms: 2, max_digits: 1}."
        )

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        rg = require_reasoning_gym()
        o = options
        try:
            self.ds = rg.create_dataset(o.task, size=o.size, seed=o.seed, **o.config)
        except Exception as e:
            raise ValueError(f"data: reasoning-gym could not create task '{o.task}' with {o.config}: {e}") from e

    columns = ["question", "answer", "metadata"]

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, index):
        return self.ds[index]


@hookimpl
def register_datasets(register):
    register("hf", HFDataset)
    register("reasoning_gym", ReasoningGym)
