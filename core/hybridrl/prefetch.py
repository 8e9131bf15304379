"""Asynchronous rollout (``rollout.async: k``): the engine generates the next steps' batches while
the trainer updates on this one, with weights at most k updates old.

One worker thread runs the rollout and reward stage of the steps ahead, in step order; the
trainer takes them in order. When step s starts, step s + k is queued; a weight sync waits until
every queued batch is finished, so the batch of step s + k is generated with the weights the
engine had when step s started: k updates old when it is trained on (the first k + 1 steps use
the initial weights), recorded per response in ``policy_version`` (the engine session's version:
the updates the engine's weights hold; a server that reloads every ``sync_every`` updates holds
older ones, and the staleness metric counts them). Deterministic: the steps' prompts, seeds and
weight versions do not depend on timing. A checkpoint waits for the batches in
flight and saves them, so a resumed run trains on the very batches the uninterrupted one would have.

With an engine that updates in flight (:meth:`hybridrl.session.EngineSession.updates_in_flight`)
a sync does not wait: the batches in flight go on under the new weights, each token records the
version that sampled it (``token_versions``), and staleness is counted per token. The versions a
token gets then depend on timing; the bound stays: a token is at most k updates old.
"""

from __future__ import annotations

import concurrent.futures as cf

import torch

from hybridrl.batch import Batch
from hybridrl.metrics import Timer


def pack(batch: Batch) -> dict:
    return {"tensors": dict(batch.tensors), "lists": {k: list(v) for k, v in batch.lists.items()}}


def unpack(state: dict) -> Batch:
    return Batch(dict(state["tensors"]), {k: list(v) for k, v in state["lists"].items()})


class Prefetcher:
    """``collect(step) -> (rollout, kept, metrics)`` run ahead, up to ``depth`` steps; ``session``
    (the engine session, :mod:`hybridrl.session`) counts the updates and the version the engine holds."""

    def __init__(self, collect, depth: int, last_step: int, session):
        self.collect, self.depth, self.last_step, self.session = collect, depth, last_step, session
        self.pool = cf.ThreadPoolExecutor(1, thread_name_prefix="hybridrl-rollout")
        self.futures: dict[int, cf.Future] = {}
        self.done: dict[int, tuple] = {}  # results restored from a checkpoint

    def _run(self, step: int, version: int):
        timer = Timer()
        rollout, kept, metrics = self.collect(step, timer)  # no sync runs meanwhile: see syncing()
        for b in (rollout, kept):
            b["policy_version"] = torch.full((len(b),), version, dtype=torch.long)
        ahead = {"async/rollout_s": timer.times.get("rollout", 0.0), "async/reward_s": timer.times.get("reward", 0.0)}
        return rollout, kept, metrics | ahead

    def _fill(self, step: int) -> None:
        for s in range(step, min(step + self.depth, self.last_step) + 1):
            if s not in self.futures and s not in self.done:
                self.futures[s] = self.pool.submit(self._run, s, self.session.version)

    def take(self, step: int) -> tuple[Batch, Batch, dict[str, float]]:
        """Step ``step``'s rollout, its kept groups and metrics; starts the steps after it."""
        self._fill(step)
        result = self.done.pop(step) if step in self.done else self.futures.pop(step).result()
        rollout, kept, metrics = result
        return rollout, kept, metrics | staleness(rollout, self.session.updates)

    def before_sync(self) -> None:
        """Wait until every queued batch is generated (they come from the weights the engine had
        when they were queued), unless the engine takes the sync in flight."""
        if not self.session.updates_in_flight():
            cf.wait(list(self.futures.values()))

    def state_dict(self) -> dict:
        """The batches in flight, finished: a resumed run starts from them."""
        finished = {s: f.result() for s, f in sorted(self.futures.items())} | self.done
        self.futures, self.done = {}, finished
        return {
            "steps": {s: {"rollout": pack(r), "kept": pack(k), "metrics": m} for s, (r, k, m) in finished.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("stream"):
            raise ValueError("the checkpoint's rollout was streamed: resume with rollout.stream: true.")
        if "updates" in state:  # written before the engine session kept the count
            self.session.load_state_dict(state)
        self.done = {int(s): (unpack(v["rollout"]), unpack(v["kept"]), v["metrics"]) for s, v in state["steps"].items()}

    def close(self) -> None:
        for f in self.futures.values():
            f.cancel()
        self.pool.shutdown(wait=True)


def staleness(rollout: Batch, updates: int) -> dict[str, float]:
    """Updates between the weights that sampled the batch and the policy (``updates``): per response,
    or per sampled token where the tokens carry their versions, with the fraction of responses whose
    tokens come from more than one version (``rollout/mixed_versions``)."""
    if "token_versions" not in rollout:
        stale = (updates - rollout["policy_version"]).float()
        return {"rollout/staleness_mean": stale.mean().item(), "rollout/staleness_max": stale.max().item()}
    mask, versions = rollout["response_mask"].bool(), rollout["token_versions"]
    stale = (updates - versions[mask]).float()
    low = torch.where(mask, versions, versions.max() + 1).min(-1).values
    mixed = (torch.where(mask, versions, -1).max(-1).values > low).float()
    return {
        "rollout/staleness_mean": stale.mean().item() if stale.numel() else 0.0,
        "rollout/staleness_max": stale.max().item() if stale.numel() else 0.0,
        "rollout/mixed_versions": mixed.mean().item(),
    }
