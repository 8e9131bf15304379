"""The prefetcher of rollout.async alone: which weights each step's batch comes from, in what
order the stages run, and what a checkpoint of batches in flight restores. The end-to-end runs
with a real vLLM server are in plugins/rollout_vllm/tests/test_server.py."""

from __future__ import annotations

import threading

import torch

from hybridrl.batch import Batch
from hybridrl.prefetch import Prefetcher


class Engine:
    """Stands for the engine session and the trainer around it: a weight version the sync bumps, the
    session's count of updates and versions, and a log of what ran when (generation in the prefetch
    thread, syncs in the trainer's)."""

    def __init__(self):
        self.weights, self.log, self.lock = 0, [], threading.Lock()
        self.updates = self.version = 0

    def load_state_dict(self, state):
        self.updates, self.version = state["updates"], state["version"]

    def collect(self, step, timer):
        with self.lock:
            self.log.append(("generate", step, self.weights))
        batch = Batch({"scores": torch.full((2,), float(step))}, {"step": [step, step]})
        return batch, batch.select([0, 1]), {"reward/mean": float(step)}

    def sync(self, prefetch, holds_latest=lambda: True):
        prefetch.before_sync()
        with self.lock:
            self.weights += 1
            self.log.append(("sync", self.weights))
            self.updates += 1
            if holds_latest():
                self.version = self.updates


def run(prefetch, engine, steps, first=1, holds_latest=lambda: True):
    out = []
    for step in range(first, steps + 1):
        rollout, kept, metrics = prefetch.take(step)
        out.append((rollout.lists["step"][0], rollout["policy_version"].tolist(), metrics["rollout/staleness_max"]))
        engine.sync(prefetch, holds_latest)
    return out


def test_each_step_trains_on_a_batch_of_weights_k_updates_old():
    for depth in (1, 2):
        engine = Engine()
        p = Prefetcher(engine.collect, depth, 6, engine)
        got = run(p, engine, 6)
        p.close()
        assert [s for s, _, _ in got] == [1, 2, 3, 4, 5, 6]  # in step order
        # step s's batch was queued when step s - depth started: after s - depth - 1 syncs
        want = [max(0, s - depth - 1) for s in range(1, 7)]
        assert [v[0] for _, v, _ in got] == want
        assert [st for _, _, st in got] == [s - 1 - w for s, w in zip(range(1, 7), want, strict=True)]
        # the engine held the weights the version says while it generated (no sync ran meanwhile),
        # and generated nothing past the run's last step
        gens = {e[1]: e[2] for e in engine.log if e[0] == "generate"}
        assert gens == dict(zip(range(1, 7), want, strict=True))


def test_a_server_that_skips_reloads_keeps_the_version_it_holds():
    engine = Engine()
    p = Prefetcher(engine.collect, 1, 5, engine)
    syncs = iter([False, True, False, True, False])  # sync_every 2: the server reloads every other update
    got = run(p, engine, 5, holds_latest=lambda: next(syncs))
    p.close()
    # step 4's batch was queued at step 3, when the server held the 2 updates of its last reload
    assert [v[0] for _, v, _ in got] == [0, 0, 0, 2, 2]
    assert [st for _, _, st in got] == [0, 1, 2, 1, 2]


def test_a_checkpoint_holds_the_batches_in_flight_and_resumes_to_the_same_steps():
    engine = Engine()
    p = Prefetcher(engine.collect, 2, 6, engine)
    straight = run(p, engine, 6)
    p.close()

    engine = Engine()
    p = Prefetcher(engine.collect, 2, 6, engine)
    first = run(p, engine, 3)
    state = p.state_dict()  # steps 4 and 5 were queued: finished, and saved
    assert sorted(state["steps"]) == [4, 5] and engine.updates == 3
    p.close()
    generated = len(engine.log)

    resumed = Prefetcher(engine.collect, 2, 6, engine)
    resumed.load_state_dict(state)
    rest = run(resumed, engine, 6, first=4)
    resumed.close()
    assert first + rest == straight
    # only step 6 was generated after the resume: 4 and 5 came from the checkpoint
    assert [e[1] for e in engine.log[generated:] if e[0] == "generate"] == [6]
