"""Finished episodes, kept where a crash cannot take them (``episodes.sqlite`` in the run folder).

An episode is written, and committed, the moment its harness ends, under a key made of the harness,
the rollout call's seed, its place in the call and its task. A resumed run draws the same tasks with the same
seeds, so the rollout of a step that a kill interrupted finds the episodes that finished before the
kill and runs only the rest: each finished episode is trained exactly once in the run that goes on.

With late rewards (``reward_deadline_s``) a finished group is held here until its rewards are in;
a reward posted for a held episode is committed before it is acknowledged, and the groups handed to
each training call are written under the call's seed, so that a resumed call is answered with the
same groups. The store keeps the newest ``keep`` episodes and every held one (a resume from a
checkpoint further back runs the older ones again).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import sqlite3
import threading
from pathlib import Path

STORE = "episodes.sqlite"
SCHEMA = """
CREATE TABLE IF NOT EXISTS episodes (seq INTEGER PRIMARY KEY, key TEXT UNIQUE, episode TEXT, grp TEXT,
                                     data TEXT, reward REAL, waiting INTEGER);
CREATE TABLE IF NOT EXISTS groups (seq INTEGER PRIMARY KEY, key TEXT UNIQUE, ended REAL, handed TEXT);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT);
CREATE INDEX IF NOT EXISTS episodes_by_group ON episodes (grp);
CREATE INDEX IF NOT EXISTS episodes_by_id ON episodes (episode);
"""


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
        self.db.executescript(SCHEMA)
        path.chmod(0o600)

    def _one(self, sql: str, *args):
        with self.lock:
            return self.db.execute(sql, args).fetchone()

    def get(self, key: str) -> dict | None:
        """The episode stored under ``key``, its posted reward (late ones too) in ``state["reward"]``."""
        found = self._one("SELECT data, reward FROM episodes WHERE key = ?", key)
        if found is None:
            return None
        record = json.loads(found[0])
        if found[1] is not None:
            record["state"]["reward"] = found[1]
        return record

    def put(self, key: str, record: dict, episode: str, group: str | None = None) -> None:
        data = json.dumps(record, default=str)
        reward = record["state"].get("reward")
        waiting = reward is None and record["state"].get("lost") is None  # a reward may still come for it
        with self.lock:
            self.db.execute(
                "INSERT OR REPLACE INTO episodes (key, episode, grp, data, reward, waiting) VALUES (?, ?, ?, ?, ?, ?)",
                (key, episode, group, data, reward, waiting),
            )
            self.db.execute(
                "DELETE FROM episodes WHERE seq <= (SELECT MAX(seq) FROM episodes) - ? AND (grp IS NULL OR grp IN"
                " (SELECT key FROM groups WHERE handed IS NOT NULL))",
                (self.keep,),
            )
            self.db.execute("DELETE FROM groups WHERE handed IS NOT NULL AND key NOT IN (SELECT grp FROM episodes"
                            " WHERE grp IS NOT NULL)")  # fmt: skip

    def post_reward(self, episode: str, value: float) -> str:
        """A late reward for a stored episode, committed: ``stored``, ``unknown``, ``twice`` (it has
        one) or ``trained`` (its group was handed to a step, or it was never held)."""
        with self.lock:
            found = self.db.execute(
                "SELECT e.reward, g.handed, e.grp FROM episodes e LEFT JOIN groups g ON g.key = e.grp"
                " WHERE e.episode = ?",
                (episode,),
            ).fetchone()
            if found is None:
                return "unknown"
            if found[0] is not None:
                return "twice"
            if found[2] is None or found[1] is not None:
                return "trained"
            self.db.execute("UPDATE episodes SET reward = ? WHERE episode = ?", (value, episode))
        return "stored"

    def hold(self, group: str, ended: float) -> None:
        """A finished group of the store's episodes (``grp``), held until handed to a training call."""
        with self.lock:
            self.db.execute("INSERT OR IGNORE INTO groups (key, ended) VALUES (?, ?)", (group, ended))

    def held(self) -> list[tuple[str, float, int]]:
        """The groups not yet handed to a call, oldest first: (key, when it ended, rewards it waits for)."""
        with self.lock:
            return self.db.execute(
                "SELECT g.key, g.ended, SUM(e.reward IS NULL AND e.waiting) FROM groups g JOIN episodes e"
                " ON e.grp = g.key WHERE g.handed IS NULL GROUP BY g.key ORDER BY g.seq"
            ).fetchall()

    def members(self, group: str) -> list[str]:
        """The keys of a group's episodes, in their place's order."""
        with self.lock:
            keys = [k for (k,) in self.db.execute("SELECT key FROM episodes WHERE grp = ?", (group,))]
        return sorted(keys, key=lambda k: int(k.split("/")[1]))

    def handed(self, call: str) -> list[str]:
        """The groups handed to the training call ``call`` (its seed), in their order."""
        with self.lock:
            rows = self.db.execute("SELECT key FROM groups WHERE handed = ? ORDER BY seq", (call,)).fetchall()
        return [k for (k,) in rows]

    def hand(self, call: str, groups: list[str]) -> None:
        """``groups`` go to the training call ``call``: one transaction, so a resumed call gets them again."""
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            self.db.executemany("UPDATE groups SET handed = ? WHERE key = ?", [(call, g) for g in groups])
            self.db.execute("COMMIT")

    def token(self) -> str:
        """The gateway's token, kept for the run: a reward posted hours later reaches a resumed run."""
        with self.lock:
            self.db.execute("INSERT OR IGNORE INTO meta VALUES ('token', ?)", (secrets.token_urlsafe(32),))
            return self.db.execute("SELECT value FROM meta WHERE name = 'token'").fetchone()[0]

    def close(self) -> None:
        with self.lock:
            self.db.close()
