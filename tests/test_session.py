"""The engine session (hybridrl.session): one caller of the engine whatever the thread, the policy
version stamped under the lock, the seed rule written once."""

from __future__ import annotations

import threading
import time

import torch

from hybridrl.components import RolloutEngine, RolloutOutput, SamplingParams
from hybridrl.config import RolloutConfig
from hybridrl.session import EngineSession, rollout_seed


class Watched(RolloutEngine):
    """An engine that records overlapping calls and the weights each generation used."""

    def __init__(self, holds_latest=lambda: True):
        self.inside, self.overlaps, self.weights, self.seen = 0, 0, 0, []
        self._holds = holds_latest

    def _enter(self):
        self.inside += 1
        self.overlaps += self.inside > 1
        time.sleep(0.002)  # long enough for another thread to come in, were it let in

    def generate(self, prompts, sampling):
        self._enter()
        used = self.weights
        self.inside -= 1
        self.seen.append(used)
        return RolloutOutput([[used]] * len(prompts), [[0.0]] * len(prompts), ["stop"] * len(prompts))

    def update_weights(self, named_tensors):
        self._enter()
        list(named_tensors)
        self.weights += 1
        self.inside -= 1

    def holds_latest_weights(self):
        return self._holds()


def test_calls_from_many_threads_never_overlap_and_answers_carry_the_version_that_sampled_them():
    engine = Watched()
    session = EngineSession(engine, RolloutConfig(n=1))
    answers, stop = [], threading.Event()

    def ask():
        while not stop.is_set():
            out = session.generate([[1, 2]], SamplingParams(n=1, max_tokens=1))
            answers.append((out.policy_version, out.token_ids[0][0]))

    askers = [threading.Thread(target=ask) for _ in range(3)]
    for a in askers:
        a.start()
    for _ in range(5):
        session.sync([("w", torch.zeros(1))])
    stop.set()
    for a in askers:
        a.join()
    assert engine.overlaps == 0
    assert session.updates == session.version == engine.weights == 5
    # every answer's version is the number of syncs the weights that sampled it had taken
    assert answers and all(version == used for version, used in answers)


def test_a_server_that_skips_a_reload_keeps_its_version_and_resends_do_not_count():
    reloads = iter([True, False, True])
    session = EngineSession(Watched(lambda: next(reloads)), RolloutConfig(n=1))
    session.sync([], update=False)  # a resume's or a check's resend: the same weights again
    assert (session.updates, session.version) == (0, 0)
    versions = []
    for _ in range(3):
        session.sync([])
        versions.append(session.version)
    assert versions == [1, 1, 3] and session.updates == 3
    assert session.state_dict() == {"updates": 3, "version": 3}


def test_the_step_seed_rule_and_each_engines_per_request_seeds():
    rollout = RolloutConfig(n=4, temperature=0.7)
    session = EngineSession(Watched(), rollout, seed=3, prompts_per_step=8)
    s = session.sampling(step=5, round_=1)
    assert s.seed == rollout_seed(3, 5, 1, 0, 4) == 3 * 100_003 + 5 + 10_000_019
    assert (s.n, s.temperature) == (4, 0.7)
    # prompt i of a call: seed + i*n (vLLM seeds its sample j + j); one per sample for SGLang
    assert s.prompt_seeds(2) == [s.seed, s.seed + 4]
    assert s.sample_seeds(2) == [s.seed + k for k in range(8)]
    # the agent loop's own seeds per prompt
    turns = SamplingParams(n=2, seeds=[10, 50])
    assert turns.prompt_seeds(2) == [10, 50] and turns.sample_seeds(2) == [10, 11, 50, 51]
    assert SamplingParams().prompt_seeds(3) is None and SamplingParams().sample_seeds(3) is None
