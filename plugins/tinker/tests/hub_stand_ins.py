"""Stand-ins in the Hugging Face caches, so that code which loads a tokenizer or a dataset by its hub
name (the Tinker Cookbook's recipes) runs unchanged with nothing downloaded: a local tokenizer
under a hub model's name, and a small local dataset of a hub dataset's schema under its name."""

from __future__ import annotations

import glob
import json
import shutil
from pathlib import Path

STAND_IN = "0" * 40  # the snapshot's revision


def tokenizer(hub_cache: Path, name: str, folder: Path) -> None:
    """``folder``'s tokenizer files as the hub model ``name`` (its cache's refs/main snapshot)."""
    repo = hub_cache / f"models--{name.replace('/', '--')}"
    snapshot = repo / "snapshots" / STAND_IN
    snapshot.mkdir(parents=True, exist_ok=True)
    for path in Path(folder).iterdir():
        if path.suffix in (".json", ".txt", ".model", ".jinja") and path.is_file():
            shutil.copy(path, snapshot / path.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(STAND_IN)


def dataset(datasets_cache: Path, repo: str, config: str, splits: dict[str, list[dict]]) -> None:
    """``splits`` (rows by split) as what ``datasets.load_dataset(repo, config)`` finds in its cache
    offline: a prepared dataset under ``<namespace>___<name>/<config>/0.0.0/<hash>``."""
    from datasets.packaged_modules.json.json import Json

    namespace, name = repo.split("/")
    work = datasets_cache / "stand-in-sources" / name
    work.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, rows in splits.items():
        files[split] = str(work / f"{split}.jsonl")
        Path(files[split]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    build = datasets_cache / "stand-in-build"
    builder = Json(cache_dir=str(build), dataset_name=name, config_name=config, data_files=files, hash="stand-in")
    builder.download_and_prepare()
    [prepared] = glob.glob(str(build / name / f"{config}*"))
    target = datasets_cache / f"{namespace}___{name}" / config
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(prepared, target)
    shutil.rmtree(build)
