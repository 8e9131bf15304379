"""``hybridrl serve``: answer users with the policy, keep their ratings, learn from them while serving.

One process, three parts (docs/online.md):

- :class:`FeedbackStore`: SQLite in WAL mode (``RUN_DIR/online.sqlite``) holding every answer (its
  messages, prompt and response token ids, the engine's logprobs, the policy version that sampled
  it) and every rating. Each write commits before the HTTP reply, so what the server acknowledged
  survives a crash.
- :class:`Learner`: a thread that, once ``online.update_every`` new ratings are in (or the oldest
  is ``online.update_every_s`` old), trains the policy on them: advantage = rating - baseline
  (:func:`advantages`), the algorithm's policy loss with its KL term and its off-policy correction
  (answers from older versions), then a checkpoint, then the new weights into the engine. Its
  progress (the last rating trained on, the running baseline) is in the checkpoint: a restart
  continues from the last saved version and trains again on what came after it.
- :func:`make_server`: OpenAI-style ``POST /v1/chat/completions``, ``POST /v1/feedback``,
  ``GET /v1/status`` and ``GET /health`` on 127.0.0.1 unless told otherwise, with a token on any
  other address, request size and rate limits, and the checks every server of hybridrl makes
  (hybridrl.http: Host and Origin, the token before the body, throttled wrong tokens, timeouts).
  The run folder and its files are created for their owner alone.
"""

from __future__ import annotations

import json
import os
import queue
import sqlite3
import sys
import threading
import time
import uuid
from collections import defaultdict, deque
from pathlib import Path

import torch

from hybridrl.batch import Batch
from hybridrl.checkpoint import PRIVATE_FILE, make_private, private_files
from hybridrl.components import RolloutOutput, Sampling, SamplingParams
from hybridrl.config import ConfigError
from hybridrl.http import ALLOWED_HOSTS_ENV, HttpError, JsonHandler, JsonServer, listen, require_token
from hybridrl.prompts import encode_prompt

TOKEN_ENV = "HYBRIDRL_SERVE_TOKEN"
LOCAL_LOGGERS = {"console", "jsonl", "tensorboard"}  # answers and ratings stay on this machine
ROLES = {"system", "user", "assistant", "tool"}

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


class BadRequest(HttpError):
    """A request the server refuses; ``code`` is its HTTP status."""


# -- the store ------------------------------------------------------------------------------


class FeedbackStore:
    """Answers and ratings in SQLite (WAL journal, a full sync at each commit)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE))  # users' chats: the owner's alone
        os.chmod(self.path, PRIVATE_FILE)  # a store of an older version; SQLite gives its -wal file this mode
        self.db = sqlite3.connect(self.path, check_same_thread=False, timeout=30, isolation_level=None)
        self.lock = threading.Lock()
        with self.lock:
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.executescript(SCHEMA)

    def add_answer(self, answer: dict) -> None:
        row = {k: json.dumps(v) if isinstance(v, list) else v for k, v in answer.items()}
        with self.lock:
            self.db.execute(
                "INSERT INTO answers VALUES (:id, :created, :version, :messages, :prompt_ids, :response_ids, "
                ":logprobs, :text, :finish_reason)",
                row,
            )

    def add_rating(self, answer_id: str, rating: float, preferred: str | None) -> int:
        """Store a rating; its sequence number. Unknown answer: 404; rated already: 409."""
        with self.lock:
            if self.db.execute("SELECT 1 FROM answers WHERE id = ?", (answer_id,)).fetchone() is None:
                raise BadRequest(404, f"no answer with id {answer_id!r}: use the id of a chat completion")
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


# -- the learner ----------------------------------------------------------------------------


def advantages(ratings: list[float], prompts: list, mode: str, baseline: float | None) -> list[float]:
    """rating - baseline for each answer. ``leave_one_out``: the mean rating of the other answers
    to the same prompt among these (RLOO); ``running``: ``baseline``, the mean of earlier ratings;
    ``auto``: leave-one-out where another answer to the prompt is here, running otherwise. Without
    earlier ratings (the first update) the running baseline is the mean of these."""
    groups = defaultdict(list)
    for i, p in enumerate(prompts):
        groups[tuple(p)].append(i)
    fallback = baseline if baseline is not None else sum(ratings) / len(ratings)
    out = []
    for i, p in enumerate(prompts):
        others = [ratings[j] for j in groups[tuple(p)] if j != i]
        b = sum(others) / len(others) if others and mode != "running" else fallback
        out.append(ratings[i] - b)
    return out


class Batcher:
    """Requests that arrive while the engine is busy are answered together: one call of
    ``generate(prompts, max_tokens)`` for all that wait (up to ``size``), each answer cut to its own
    ``max_tokens`` (the first k tokens of a sample, with their logprobs, are a sample of k tokens)."""

    def __init__(self, generate, size: int):
        self.generate, self.size, self.queue = generate, size, queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="hybridrl-batcher", daemon=True)
        self.thread.start()

    def submit(self, prompt_ids: list[int], max_tokens: int) -> dict:
        """The answer (ids, logprobs, finish reason, version) to one prompt; blocks until it is there."""
        item = {"prompt": prompt_ids, "max_tokens": max_tokens, "done": threading.Event()}
        self.queue.put(item)
        item["done"].wait()
        if "error" in item:
            raise item["error"]
        return item["answer"]

    def _loop(self) -> None:
        while (first := self.queue.get()) is not None:
            items = [first]
            while len(items) < self.size and not self.queue.empty():
                item = self.queue.get()
                if item is None:  # closing: answer these, then stop
                    self.queue.put(None)
                    break
                items.append(item)
            try:
                answers = self.generate([i["prompt"] for i in items], max(i["max_tokens"] for i in items))
                for item, a in zip(items, answers):
                    k = item["max_tokens"]
                    cut = len(a["ids"]) > k
                    item["answer"] = a | {"ids": a["ids"][:k], "logprobs": a["logprobs"][:k]}
                    item["answer"]["finish_reason"] = "length" if cut else a["finish_reason"]
            except Exception as e:  # every request of the call gets the error
                for item in items:
                    item["error"] = e
            for item in items:
                item["done"].set()

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()


class Learner:
    """Trains the trainer's policy on users' ratings, on its own thread (see the module docstring)."""

    def __init__(self, trainer, store: FeedbackStore):
        self.trainer, self.store, self.options = trainer, store, trainer.config.online
        self.version = trainer.start_step  # updates the policy has had
        self.consumed = 0  # sequence number of the last rating trained on
        self.rating_sum, self.rating_count = 0.0, 0  # of the ratings trained on: the running baseline
        self.engine_lock = threading.Lock()  # one generate call or weight swap at a time
        self.wake, self.stopping = threading.Event(), threading.Event()
        self.learning, self.error = False, None
        self.thread = threading.Thread(target=self._loop, name="hybridrl-learner", daemon=True)
        self.batcher = Batcher(self._generate, self.options.batch_requests)

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "rating_sum": self.rating_sum, "rating_count": self.rating_count}

    def load_state_dict(self, state: dict) -> None:
        self.consumed, self.rating_sum, self.rating_count = (
            state["consumed"],
            state["rating_sum"],
            state["rating_count"],
        )

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()
        if self.thread.is_alive():
            self.thread.join()
        self.batcher.close()

    def due(self) -> list[dict]:
        """The ratings of the next update, or [] when it is not due."""
        o = self.options
        rows = self.store.pending(self.consumed, o.max_batch)
        if len(rows) >= o.update_every:
            return rows
        if rows and o.update_every_s and time.time() - rows[0]["created"] >= o.update_every_s:
            return rows
        return []

    def _loop(self) -> None:
        while not self.stopping.is_set():
            self.wake.wait(timeout=1.0)
            self.wake.clear()
            rows = self.due()
            if rows and not self.stopping.is_set():
                try:
                    self.update(rows)
                except Exception as e:  # the server keeps answering with the last good weights
                    self.error = f"{type(e).__name__}: {e}"
                    print(f"error: online update after version {self.version} failed: {self.error}", file=sys.stderr)
                    self.stopping.set()

    def batch(self, rows: list[dict]) -> Batch:
        t = self.trainer
        prompts = [r["prompt_ids"] for r in rows]
        out = RolloutOutput(
            [r["response_ids"] for r in rows], [r["logprobs"] for r in rows], [r["finish_reason"] for r in rows]
        )
        batch = Batch.from_rollout(prompts, out, 1, t.tokenizer.pad_token_id)
        batch["rating"] = torch.tensor([r["rating"] for r in rows], dtype=torch.float32)
        batch["response_text"] = [r["text"] for r in rows]
        batch["prompt_text"] = t.tokenizer.batch_decode(prompts)
        batch["answer"] = batch["metadata"] = [None] * len(rows)
        return batch

    def update(self, rows: list[dict]) -> dict[str, float]:
        """One update on ``rows``: advantages, the policy loss, a checkpoint, the engine's new weights."""
        t, o = self.trainer, self.options
        self.learning, start = True, time.perf_counter()
        try:
            batch = self.batch(rows)
            metrics = t.rewards.score(batch)  # reward 'user_rating': batch["scores"]
            scores = batch["scores"].tolist()
            baseline = self.rating_sum / self.rating_count if self.rating_count else None
            adv = torch.tensor(advantages(scores, [r["prompt_ids"] for r in rows], o.baseline, baseline))
            batch["advantages"] = adv[:, None] * batch["response_mask"].float()
            batch = batch.to(t.ctx.device)
            metrics |= t.compute_logprobs(batch)
            version = self.version + 1
            metrics |= t.update(batch, version)
            self.consumed = rows[-1]["seq"]
            self.rating_sum += sum(scores)
            self.rating_count += len(scores)
            if version % o.save_every == 0:
                t.save(version)  # with the learner's state: a restart continues after these ratings
            trained = time.perf_counter()
            t.sync()  # the session stamps the new version under the lock of the sync
            self.version = version
            metrics["timing/update"], metrics["timing/sync"] = trained - start, time.perf_counter() - trained
            counts = self.store.counts(self.consumed, time.time() - 600)
            metrics |= {
                "online/version": float(version),
                "online/ratings": float(len(rows)),
                "online/staleness_mean": sum(version - 1 - r["version"] for r in rows) / len(rows),
                "online/rating_mean_all": float(counts["mean"] or 0.0),
                "online/ratings_per_min": counts["recent"] / 10.0,
                "online/answers": float(counts["answers"]),
                "online/pending": float(counts["pending"]),
            }
            return t.log(version, metrics, batch)
        finally:
            self.learning = False

    def answer(self, messages: list[dict], max_tokens: int | None) -> dict:
        """Generate one answer to ``messages`` with the current weights and store it."""
        t = self.trainer
        cfg = t.config
        try:
            prompt_ids, _ = encode_prompt({cfg.data.prompt_column: messages}, cfg.data, t.tokenizer)
        except ConfigError as e:
            raise BadRequest(400, str(e)) from None
        limit = cfg.rollout.max_tokens
        if max_tokens is not None and not (isinstance(max_tokens, int) and 0 < max_tokens <= limit):
            raise BadRequest(400, f"'max_tokens' must be an integer from 1 to {limit} (rollout.max_tokens)")
        a = self.batcher.submit(prompt_ids, max_tokens or limit)
        answer = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "created": time.time(),
            "version": a["version"],
            "messages": json.dumps(messages),
            "prompt_ids": prompt_ids,
            "response_ids": a["ids"],
            "logprobs": a["logprobs"],
            "text": t.tokenizer.decode(a["ids"], skip_special_tokens=True),
            "finish_reason": a["finish_reason"],
        }
        self.store.add_answer(answer)
        return answer

    def _generate(self, prompts: list[list[int]], max_tokens: int) -> list[dict]:
        """One sample of up to ``max_tokens`` for each prompt, with the weights of one version."""
        t = self.trainer
        keys = t.config.rollout.model_dump(include=set(Sampling.model_fields))
        sampling = SamplingParams(**keys | {"n": 1, "max_tokens": max_tokens, "seed": uuid.uuid4().int % 2**31})
        out = t.session.generate(prompts, sampling)
        return [
            {"ids": ids, "logprobs": lp, "finish_reason": reason, "version": out.policy_version}
            for ids, lp, reason in zip(out.token_ids, out.logprobs, out.finish_reasons)
        ]


# -- the HTTP server ------------------------------------------------------------------------


def check_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest(400, "'messages' must be a non-empty list of {role, content} objects")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise BadRequest(400, f"each message needs a role ({', '.join(sorted(ROLES))}) and a string content")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def parse_rating(value, o) -> float:
    """A number in [rating_min, rating_max], or 'up' / 'down' (thumbs)."""
    if value in ("up", "down"):
        return o.rating_max if value == "up" else o.rating_min
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not o.rating_min <= value <= o.rating_max:
        raise BadRequest(400, f"'rating' must be a number from {o.rating_min:g} to {o.rating_max:g}, or 'up' / 'down'")
    return float(value)


class RateLimit:
    """At most ``per_minute`` requests per client address in any 60 seconds."""

    def __init__(self, per_minute: int):
        self.per_minute, self.seen, self.lock = per_minute, defaultdict(deque), threading.Lock()

    def allow(self, client: str) -> bool:
        now = time.monotonic()
        with self.lock:
            times = self.seen[client]
            while times and now - times[0] > 60:
                times.popleft()
            if len(times) >= self.per_minute:
                return False
            times.append(now)
            return True


def make_server(
    learner: Learner, host: str, port: int, token: str | None, options, allow: tuple[str, ...] = ()
) -> JsonServer:
    """The server (not started: call serve_forever). A non-loopback ``host`` needs a ``token``; ``allow``:
    Host names and origins it answers beside the loopback ones and ``$HYBRIDRL_ALLOWED_HOSTS``."""
    require_token("serve", host, token, TOKEN_ENV)
    limit = RateLimit(options.requests_per_minute)

    class Handler(JsonHandler):
        def routes(self):
            return {
                ("GET", "/health"): self._health,
                ("GET", "/v1/status"): self._status,
                ("POST", "/v1/chat/completions"): self._chat,
                ("POST", "/v1/feedback"): self._feedback,
            }

        def throttle(self):
            if not limit.allow(self.client_address[0]):
                raise HttpError(429, f"over {options.requests_per_minute} requests a minute", {"Retry-After": "60"})

        def _health(self) -> dict:
            return {"status": "ok" if learner.error is None else "learner stopped"}

        def _status(self) -> dict:
            counts = learner.store.counts(learner.consumed, time.time() - 600)
            return {
                "policy_version": learner.version,
                "learning": learner.learning,
                "learner_error": learner.error,
                "answers": counts["answers"],
                "ratings": counts["ratings"],
                "untrained_ratings": counts["pending"],
                "rating_mean": counts["mean"],
            }

        def _chat(self, body) -> dict:
            body = json_object(body)
            if body.get("stream"):
                raise BadRequest(400, "'stream' is not supported: leave it out or set it to false")
            if body.get("n", 1) != 1:
                raise BadRequest(400, "'n' must be 1: each answer is rated on its own")
            a = learner.answer(check_messages(body.get("messages")), body.get("max_tokens"))
            prompt, completion = len(a["prompt_ids"]), len(a["response_ids"])
            return {
                "id": a["id"],
                "object": "chat.completion",
                "created": int(a["created"]),
                "model": body.get("model") if isinstance(body.get("model"), str) else "policy",
                "policy_version": a["version"],
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": a["text"]},
                        "finish_reason": a["finish_reason"],
                    }
                ],
                "usage": {
                    "prompt_tokens": prompt,
                    "completion_tokens": completion,
                    "total_tokens": prompt + completion,
                },
            }

        def _feedback(self, body) -> dict:
            body = json_object(body)
            answer_id = body.get("id")
            if not isinstance(answer_id, str):
                raise BadRequest(400, "'id' must be the id of a chat completion")
            rating = parse_rating(body.get("rating"), options)
            preferred = body.get("preferred")
            if preferred is not None and not isinstance(preferred, str):
                raise BadRequest(400, "'preferred' must be a string: the answer the user would have wanted")
            seq = learner.store.add_rating(answer_id, rating, preferred)
            learner.wake.set()
            return {"id": answer_id, "rating": rating, "stored": True, "seq": seq}

    return listen(
        "serve",
        host,
        port,
        Handler,
        token=token,
        max_body=options.max_request_bytes,
        max_body_name=f"online.max_request_bytes={options.max_request_bytes}",
        allow=allow,
        hint=f"list it in ${ALLOWED_HOSTS_ENV} (comma-separated) to allow it",
    )


def json_object(body) -> dict:
    if not isinstance(body, dict):
        raise BadRequest(400, "the body must be a JSON object")
    return body


# -- the command ----------------------------------------------------------------------------


def check_config(cfg) -> None:
    """What ``hybridrl serve`` needs of a run config, said before any model loads."""
    if [r.function for r in cfg.rewards] != ["user_rating"]:
        raise ConfigError(
            "hybridrl serve trains on users' ratings: set rewards: [{function: user_rating}] "
            f"(the config has {', '.join(r.function for r in cfg.rewards)})."
        )
    remote = sorted(set(cfg.logging.loggers) - LOCAL_LOGGERS)
    if remote:
        raise ConfigError(
            f"hybridrl serve keeps answers and ratings on this machine: logging.loggers {', '.join(remote)} would "
            f"send them elsewhere. Use {', '.join(sorted(LOCAL_LOGGERS))}."
        )
    if cfg.rollout.agent is not None:
        raise ConfigError("hybridrl serve answers single turns with an engine in this process: unset rollout.agent.")


class Server:
    """The trainer, its learner, the store and the HTTP server of one ``hybridrl serve``."""

    def __init__(
        self, cfg, host: str = "127.0.0.1", port: int = 8000, token: str | None = None, allow: tuple[str, ...] = ()
    ):
        from hybridrl.trainer import Trainer

        check_config(cfg)
        require_token("serve", host, token, TOKEN_ENV)  # before loading any model
        if cfg.trainer.run_dir:  # serving continues the run of that folder, if it has checkpoints
            cfg.trainer.resume = True
        self.trainer = Trainer(cfg, name="serve")
        t = self.trainer
        with private_files():  # the run folder, config.yaml, the logs and the store: the owner's alone
            t.setup()
            if t.algorithm.trained_models():
                raise ConfigError(
                    f"hybridrl serve trains the policy alone: algorithm '{cfg.algorithm.name}' also trains "
                    f"{', '.join(m.label for m in t.algorithm.trained_models())}. "
                    "Use algorithm grpo (or ppo with critic: false)."
                )
            self.store = FeedbackStore(t.run_dir / "online.sqlite")
            self.learner = Learner(t, self.store)
            t.extra_state["online"] = self.learner
            t.resume()  # the newest checkpoint of run_dir, when there is one: version and learner state
            self.learner.version = t.start_step
            for logger in t.loggers:
                logger.open(0, t.start_step)  # no last step: it serves until stopped
        make_private(t.run_dir)  # files an earlier version wrote
        self.http = make_server(self.learner, host, port, token, cfg.online, allow)

    @property
    def url(self) -> str:
        host, port = self.http.server_address[:2]
        return f"http://{host}:{port}"

    def serve_forever(self) -> None:
        self.learner.start()
        try:
            self.http.serve_forever()
        finally:
            self.close()

    def close(self) -> None:
        self.http.server_close()
        self.learner.stop()
        for logger in self.trainer.loggers:
            logger.close()
        self.trainer.rewards.close()
        self.trainer.session.close()
        self.store.close()
