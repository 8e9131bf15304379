"""Tinker's futures: every long call answers at once with a request id, and the client polls for the
result (``retrieve_future``), which the server holds back until it is ready or a wait has passed.

One worker thread runs every call, in order: a model's training calls strictly by their ``seq_id``
(a client sends the chunks of one ``forward_backward`` in parallel, the first one last), sampling
calls as they come, several with the same sampler and settings in one engine call (those waiting,
and those that arrive within :data:`GATHER_S` of the last one: a client sends one per prompt).
A training call whose predecessor never arrives (a client that gave up on it) runs after
:data:`GAP_S` seconds, so that one lost request cannot stop a model for good.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

GAP_S = 60.0  # seconds a model's later calls wait for a missing seq_id
KEEP_S = 3600.0  # seconds a finished result is kept for a client that has not fetched it
GATHER_S, GATHER_ROUNDS = 0.02, 50  # a sample call waits for more of its kind while they keep coming (at most 1 s)


class UserError(ValueError):
    """A call the client got wrong: the future fails with category ``user`` and this message."""


@dataclass(eq=False)  # one future is itself only
class Future:
    request_id: str
    kind: str  # "train" | "sample"
    run: Callable[[], Any] | None  # None for a sample: the worker batches them (``args`` says how)
    key: Any = None  # sample: calls with equal keys go in one engine call
    args: Any = None
    result: Any = None
    error: tuple[str, str] | None = None  # (message, category)
    done: threading.Event = field(default_factory=threading.Event)
    finished: float = 0.0

    def finish(self, result: Any = None, error: tuple[str, str] | None = None) -> None:
        self.result, self.error, self.finished = result, error, time.time()
        self.done.set()


class Worker:
    """The futures and the one thread that resolves them (see the module docstring). ``sample``
    answers a list of sample futures with equal keys: it returns one result per future."""

    def __init__(self, sample: Callable[[list[Future]], list[Any]]):
        self.sample = sample
        self.futures: dict[str, Future] = {}
        self.by_seq: dict[tuple[str, int], Future] = {}  # a retried submission gets the same future
        self.waiting: dict[str, dict[int, tuple[float, Future]]] = {}  # model -> seq_id -> (arrived, future)
        self.next_seq: dict[str, int] = {}
        self.ready: list[Future] = []
        self.cond = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="tinker-worker", daemon=True)
        self.thread.start()

    def submit_train(self, model_id: str, seq_id: int, run: Callable[[], Any], first: int = 1) -> Future:
        """A training call of ``model_id`` that runs after its ``seq_id - 1`` (``first``: the model's first)."""
        with self.cond:
            known = self.by_seq.get((model_id, seq_id))
            if known is not None:
                return known
            f = self._new("train", run)
            self.by_seq[(model_id, seq_id)] = f
            self.next_seq.setdefault(model_id, first)
            if seq_id < self.next_seq[model_id]:
                f.finish(error=(f"seq_id {seq_id} of model {model_id} comes after its later calls ran", "user"))
                return f
            self.waiting.setdefault(model_id, {})[seq_id] = (time.monotonic(), f)
            self._release(model_id)
            return f

    def submit_sample(self, key: Any, args: Any) -> Future:
        with self.cond:
            f = self._new("sample", None, key=key, args=args)
            self.ready.append(f)
            self.cond.notify()
            return f

    def submit(self, run: Callable[[], Any]) -> Future:
        """A call outside any model's order (creating a model, a sampling session)."""
        with self.cond:
            f = self._new("train", run)
            self.ready.append(f)
            self.cond.notify()
            return f

    def get(self, request_id: str) -> Future | None:
        with self.cond:
            return self.futures.get(request_id)

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join(timeout=60)

    def _new(self, kind: str, run, **extra) -> Future:
        f = Future(f"req-{uuid.uuid4().hex}", kind, run, **extra)
        self.futures[f.request_id] = f
        return f

    def _release(self, model_id: str) -> None:
        """Move the model's calls that are next in order to the ready list (under the lock)."""
        waiting = self.waiting.get(model_id, {})
        while self.next_seq[model_id] in waiting:
            _, f = waiting.pop(self.next_seq[model_id])
            self.next_seq[model_id] += 1
            self.ready.append(f)
            self.cond.notify()

    def _skip_gaps(self) -> None:
        now = time.monotonic()
        for model_id, waiting in self.waiting.items():
            if waiting and now - min(t for t, _ in waiting.values()) > GAP_S:
                self.next_seq[model_id] = min(waiting)
                self._release(model_id)

    def _take(self) -> list[Future] | None:
        with self.cond:
            while not self.ready and not self.stopping:
                self.cond.wait(timeout=5.0)
                self._skip_gaps()
                self._forget()
            if self.stopping:
                return None
            first = self.ready.pop(0)
            if first.kind != "sample":
                return [first]
            batch = [first]
            for _ in range(GATHER_ROUNDS):  # while more of the same keep coming (a client sends one per prompt)
                same = [f for f in self.ready if f.kind == "sample" and f.key == first.key]
                self.ready = [f for f in self.ready if f not in same]
                batch += same
                if not self.cond.wait(timeout=GATHER_S):
                    break
            batch += [f for f in self.ready if f.kind == "sample" and f.key == first.key]
            self.ready = [f for f in self.ready if f not in batch]
            return batch

    def _forget(self) -> None:
        old = [k for k, f in self.futures.items() if f.finished and time.time() - f.finished > KEEP_S]
        for k in old:
            del self.futures[k]

    def _loop(self) -> None:
        while (batch := self._take()) is not None:
            try:
                results = self.sample(batch) if batch[0].kind == "sample" else [batch[0].run()]
                for f, r in zip(batch, results, strict=True):
                    f.finish(r)
            except UserError as e:
                for f in batch:
                    f.finish(error=(str(e), "user"))
            except Exception as e:  # the server keeps serving; the client sees what failed
                ref = uuid.uuid4().hex[:8]
                print(f"tinker: error {ref} in a {batch[0].kind} call:", file=sys.stderr)
                traceback.print_exc()
                for f in batch:
                    f.finish(error=(f"{type(e).__name__}: {e} (server log: error {ref})", "server"))
