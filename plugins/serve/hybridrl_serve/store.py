"""The store of ``hybridrl serve``: every answer and every rating, in SQLite.

The database (``RUN_DIR/online.sqlite``) runs in WAL mode with a full sync at each commit, and
each write commits before the HTTP reply: what the server acknowledged survives a crash. It holds
users' chats: its files are their owner's alone (the store keeps them so; the core's list of run
files, ``hybridrl.checkpoint.RUN_FILES``, knows only the core's).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from pathlib import Path

from hybridrl.checkpoint import PRIVATE_FILE
from hybridrl_serve.api import BadRequest

STORE = "online.sqlite"  # in the run folder

SCHEMA = """
CREATE TABLE IF NOT EXISTS answers (
    id TEXT PRIMARY KEY, created REAL NOT NULL, version INTEGER NOT NULL, messages TEXT NOT NULL,
    prompt_ids TEXT NOT NULL, response_ids TEXT NOT NULL, logprobs TEXT NOT NULL, text TEXT NOT NULL,
    finish_reason TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS ratings (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, answer_id TEXT NOT NULL UNIQUE REFERENCES answers(id),
    rating REAL NOT NULL, preferred TEXT, created REAL NOT NULL
);
"""


class FeedbackStore:
    """Answers and ratings in SQLite (WAL journal, a full sync at each commit)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE))  # users' chats: the owner's alone
        for name in ("", "-wal", "-shm"):  # a store of an older version; SQLite gives new -wal/-shm files its mode
            journal = self.path.with_name(self.path.name + name)
            if journal.exists():
                os.chmod(journal, PRIVATE_FILE)
        self.db = sqlite3.connect(self.path, check_same_thread=False, timeout=30, isolation_level=None)
        self.lock = threading.Lock()
        with self.lock:
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.executescript(SCHEMA)

    def add_answers(self, answers: list[dict]) -> None:
        """The answers of one reply (its choices), in one commit."""
        rows = [{k: json.dumps(v) if isinstance(v, list) else v for k, v in a.items()} for a in answers]
        with self.lock:
            self.db.execute("BEGIN")
            try:
                self.db.executemany(
                    "INSERT INTO answers VALUES (:id, :created, :version, :messages, :prompt_ids, :response_ids, "
                    ":logprobs, :text, :finish_reason)",
                    rows,
                )
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")

    def add_rating(self, answer_id: str, rating: float, preferred: str | None) -> int:
        """Store a rating; its sequence number. Unknown answer: 404; rated already: 409."""
        with self.lock:
            if self.db.execute("SELECT 1 FROM answers WHERE id = ?", (answer_id,)).fetchone() is None:
                why = f"no answer {answer_id!r}: send the id of a chat completion (and 'choice', one of its choices)"
                raise BadRequest(404, why)
            try:
                cur = self.db.execute(
                    "INSERT INTO ratings (answer_id, rating, preferred, created) VALUES (?, ?, ?, ?)",
                    (answer_id, rating, preferred, time.time()),
                )
            except sqlite3.IntegrityError:
                raise BadRequest(409, f"answer {answer_id!r} is rated already") from None
            return cur.lastrowid

    def pending(self, after: int, limit: int) -> list[dict]:
        """The oldest ``limit`` ratings after sequence number ``after``, with their answers."""
        with self.lock:
            cur = self.db.execute(
                "SELECT r.seq, r.rating, r.created, a.id, a.version, a.prompt_ids, a.response_ids, a.logprobs, "
                "a.text, a.finish_reason FROM ratings r JOIN answers a ON a.id = r.answer_id WHERE r.seq > ? "
                "ORDER BY r.seq LIMIT ?",
                (after, limit),
            )
            names = [c[0] for c in cur.description]
            rows = [dict(zip(names, values)) for values in cur.fetchall()]
        for row in rows:
            for key in ("prompt_ids", "response_ids", "logprobs"):
                row[key] = json.loads(row[key])
        return rows

    def counts(self, after: int, since: float) -> dict:
        """Answers, ratings, ratings after sequence ``after`` (untrained), ratings since time ``since``,
        and the mean rating of all."""
        with self.lock:
            answers = self.db.execute("SELECT COUNT(*) FROM answers").fetchone()[0]
            ratings, mean = self.db.execute("SELECT COUNT(*), AVG(rating) FROM ratings").fetchone()
            pending = self.db.execute("SELECT COUNT(*) FROM ratings WHERE seq > ?", (after,)).fetchone()[0]
            recent = self.db.execute("SELECT COUNT(*) FROM ratings WHERE created >= ?", (since,)).fetchone()[0]
        return {"answers": answers, "ratings": ratings, "pending": pending, "recent": recent, "mean": mean}

    def close(self) -> None:
        with self.lock:
            self.db.close()
