"""The prefetcher of rollout.async alone: which weights each step's batch comes from, in what
order the stages run, and what a checkpoint of batches in flight restores. The end-to-end runs
with a real vLLM server are in plugins/rollout_vllm/tests/test_server.py."""

from __future__ import annotations

import threading

import pytest
import torch

from hybridrl.batch import Batch
from hybridrl.prefetch import Prefetcher, staleness


class Engine:
    """Stands for the engine session and the trainer around it: a weight version the sync bumps, the
    session's count of updates and versions, and a log of what ran when (generation in the prefetch
    thread, syncs in the trainer's)."""

    def __init__(self, in_flight=False):
        self.weights, self.log, self.lock = 0, [], threading.Lock()
        self.updates = self.version = 0
        self.in_flight = in_flight

    def updates_in_flight(self):
        return self.in_flight

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


def test_a_sync_in_flight_does_not_wait_for_the_batches_generated_ahead():
    engine, release = Engine(in_flight=True), threading.Event()
    collect = engine.collect

    def slow(step, timer):  # step 2 is still generating when step 1's update syncs
        if step == 2:
            assert release.wait(30)
        return collect(step, timer)

    p = Prefetcher(slow, 1, 2, engine)
    p.take(1)
    engine.sync(p)  # returns with step 2 in flight: the engine takes the sync while it generates
    assert not p.futures[2].done() and ("sync", 1) in engine.log
    release.set()
    rollout, _, _ = p.take(2)
    assert rollout.lists["step"] == [2, 2]
    p.close()


def test_staleness_is_counted_per_token_where_tokens_carry_their_versions():
    batch = Batch()
    batch["response_mask"] = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    batch["token_versions"] = torch.tensor([[3, 3, 4, 0], [4, 4, 0, 0], [0, 0, 0, 0]])  # 0 past the tokens
    batch["policy_version"] = torch.tensor([3, 4, 4])
    got = staleness(batch, 5)
    # five sampled tokens, 2 2 1 1 1 updates old; one response of the three spans two versions
    assert got == pytest.approx(
        {"rollout/staleness_mean": 7 / 5, "rollout/staleness_max": 2, "rollout/mixed_versions": 1 / 3}
    )
    del batch.tensors["token_versions"]  # per response, from the version each started with
    assert staleness(batch, 5) == pytest.approx({"rollout/staleness_mean": 4 / 3, "rollout/staleness_max": 2})
