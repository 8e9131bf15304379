"""Training data files as hybridrl's ``hf`` prompt source reads them, and their row counts (which
turn epochs into steps)."""

from __future__ import annotations

import json
from pathlib import Path

FORMATS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}


def data_section(files: str | list[str]) -> dict:
    """The ``data`` section of the hf source for one file (``path: FILE``) or several
    (``path: parquet``, ``data_files: [...]``)."""
    if isinstance(files, list) and len(files) == 1:
        files = files[0]
    if isinstance(files, str):
        return {"source": "hf", "path": files}
    kind = FORMATS.get(Path(files[0]).suffix.lower(), "parquet")
    return {"source": "hf", "path": kind, "data_files": list(files)}


def count_rows(files: str | list[str]) -> int | None:
    """Rows of local data files (parquet from its metadata, JSON lines, a JSON list, CSV lines);
    None when a file is not here or not of these kinds."""
    total = 0
    for name in [files] if isinstance(files, str) else files:
        path = Path(name)
        if not path.is_file():
            return None
        rows = _rows(path)
        if rows is None:
            return None
        total += rows
    return total


def _rows(path: Path) -> int | None:
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq  # a dependency of datasets

            return pq.read_metadata(path).num_rows
        if suffix == ".jsonl":
            with path.open() as f:
                return sum(1 for line in f if line.strip())
        if suffix == ".json":
            data = json.loads(path.read_text())
            return len(data) if isinstance(data, list) else None
        if suffix == ".csv":
            with path.open() as f:
                return max(0, sum(1 for line in f if line.strip()) - 1)
    except (OSError, ValueError, ImportError):
        return None
    return None
