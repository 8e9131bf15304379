"""Finished episodes, kept where a crash cannot take them (``episodes.sqlite`` in the run folder).

An episode is written, and committed, the moment its harness ends, under a key made of the harness,
the rollout call's seed, its place in the call and its task. A resumed run draws the same tasks with the same
seeds, so the rollout of a step that a kill interrupted finds the episodes that finished before the
kill and runs only the rest: each finished episode is trained exactly once in the run that goes on.
The store keeps the newest ``keep`` episodes (a resume from a checkpoint further back runs the
older ones again).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
from pathlib import Path

STORE = "episodes.sqlite"


def episode_key(harness: str, seed: int | None, index: int, row: dict) -> str:
    """The harness, the rollout call's seed, the episode's place in it and its task: a resumed run
    asks again for exactly the episodes it asked for before (another harness gets its own)."""
    task = hashlib.sha256(json.dumps([harness, row], sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"{seed}/{index}/{task}"


class EpisodeStore:
    def __init__(self, path: Path, keep: int):
        self.keep, self.lock = keep, threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")  # committed means on disk
        self.db.execute("CREATE TABLE IF NOT EXISTS episodes (seq INTEGER PRIMARY KEY, key TEXT UNIQUE, data TEXT)")
        path.chmod(0o600)

    def get(self, key: str) -> dict | None:
        with self.lock:
            found = self.db.execute("SELECT data FROM episodes WHERE key = ?", (key,)).fetchone()
        return json.loads(found[0]) if found else None

    def put(self, key: str, record: dict) -> None:
        data = json.dumps(record, default=str)
        with self.lock:
            self.db.execute("INSERT OR REPLACE INTO episodes (key, data) VALUES (?, ?)", (key, data))
            self.db.execute("DELETE FROM episodes WHERE seq <= (SELECT MAX(seq) FROM episodes) - ?", (self.keep,))

    def close(self) -> None:
        with self.lock:
            self.db.close()
