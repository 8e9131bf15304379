"""The engine session (hybridrl.session): one caller of the engine whatever the thread, the policy
version stamped under the lock, the seed rule written once, and the engine lifecycle
(RolloutEngine's docstring) kept by the session alone: through real training with evaluation, the
sync check, a resume and rollout.async, against an engine that raises on any call out of order."""

from __future__ import annotations

import importlib.util
import itertools
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from hybridrl_testing import SevensPlugin, metrics_rows

from hybridrl.components import RolloutEngine, RolloutOutput, RunContext, SamplingParams
from hybridrl.config import RolloutConfig, load_config
from hybridrl.errors import StageError
from hybridrl.models import load_tokenizer
from hybridrl.run import build_run
from hybridrl.session import EngineSession, rollout_seed
from hybridrl.trainer import Trainer

_spec = importlib.util.spec_from_file_location("strict_engine", Path(__file__).parent / "strict_engine.py")
strict_engine = sys.modules["strict_engine"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(strict_engine)
LifecycleError, StrictEngine, StrictPlugin = (
    strict_engine.LifecycleError,
    strict_engine.StrictEngine,
    strict_engine.StrictPlugin,
)


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


class InFlight(Watched):
    """An engine that takes syncs while it generates: a generation spans a sync and says per token
    how many syncs the engine had taken (``token_versions``)."""

    def __init__(self, holds_latest=lambda: True):
        super().__init__(holds_latest)
        self.started, self.release, self.labels = threading.Event(), threading.Event(), None

    def updates_in_flight(self):
        return True

    def generate(self, prompts, sampling):
        before = self.weights
        self.started.set()
        assert self.release.wait(10)
        labels = self.labels or [before, self.weights]
        return RolloutOutput([[1, 2]], [[0.0, 0.0]], ["stop"], token_versions=[labels])


def test_a_sync_lands_during_a_generation_of_an_engine_that_updates_in_flight():
    engine = InFlight(lambda: engine.weights != 2)  # the second sync is one a server skips (sync_every)
    session = EngineSession(engine, RolloutConfig(n=1))
    session.sync([])  # version 1
    got = {}
    thread = threading.Thread(target=lambda: got.setdefault("out", session.generate([[1]], SamplingParams(n=1))))
    thread.start()
    assert engine.started.wait(10)
    session.sync([])  # lands while the generation runs: the session does not hold it back
    session.sync([])  # a third: the engine loaded it; its second it did not (version 1 still)
    engine.release.set()
    thread.join()
    out = got["out"]
    # the engine counts its syncs (1 before, 3 after); the session gives the policy versions they held
    assert out.policy_version == 1 and out.token_versions == [[1, 3]] and session.loaded == [0, 1, 1, 3]
    # a count the session never saw (another trainer's syncs of the same server): refused, not trained on
    engine.labels, engine.started, engine.release = [3, 7], threading.Event(), threading.Event()
    engine.release.set()
    with pytest.raises(StageError, match="sampled by the weights of sync 7, but the engine has had 3 syncs"):
        session.generate([[1]], SamplingParams(n=1))


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


# -- the engine lifecycle ---------------------------------------------------------------------------

PROMPT, SAMPLING = [[5, 6, 7]], SamplingParams(n=2, max_tokens=4, seed=0)


@pytest.fixture
def strict(tiny_model, tmp_path):
    """A strict engine on the tiny model, and a copy of its weights (what a sync sends)."""
    ctx = RunContext(tiny_model, load_tokenizer(tiny_model), torch.device("cpu"), torch.float32, 0, tmp_path)
    engine = StrictEngine(StrictEngine.Options(), ctx)
    return engine, [(k, v.clone()) for k, v in engine.hf.model.state_dict().items()]


def names(engine) -> list[str]:
    """The engine's calls but ``metrics``, each run of one call written once."""
    return [k for k, _ in itertools.groupby(c for c, _ in engine.calls if c != "metrics")]


def test_the_strict_engine_refuses_every_call_out_of_order(strict):
    engine, weights = strict
    first = engine.generate(PROMPT, SAMPLING)  # built awake
    with pytest.raises(LifecycleError, match="wake_up while awake"):
        engine.wake_up()
    engine.sleep()
    with pytest.raises(LifecycleError, match="generate while asleep"):
        engine.generate(PROMPT, SAMPLING)
    with pytest.raises(LifecycleError, match="sleep while asleep"):
        engine.sleep()
    with pytest.raises(LifecycleError, match="weights dropped by sleep and not sent since"):
        engine.wake_up()
    engine.update_weights(weights)  # asleep: allowed, and it stays asleep
    with pytest.raises(LifecycleError, match="generate while asleep"):
        engine.generate(PROMPT, SAMPLING)
    engine.wake_up()
    assert engine.generate(PROMPT, SAMPLING).token_ids == first.token_ids  # the weights came back whole
    engine.close()
    with pytest.raises(LifecycleError, match="generate while closed"):
        engine.generate(PROMPT, SAMPLING)


def test_the_session_wakes_the_engine_to_generate_and_only_after_a_weight_sync(strict):
    engine, weights = strict
    session = EngineSession(engine, RolloutConfig(n=2))
    first = session.generate(PROMPT, SAMPLING)
    session.before_training()
    session.before_training()  # asleep already: nothing to do
    with pytest.raises(StageError, match="asked to generate while asleep, before any weight sync"):
        session.generate(PROMPT, SAMPLING)  # its sleep dropped the weights
    session.sync(weights)  # asleep, as after training
    again = session.generate(PROMPT, SAMPLING)
    session.generate(PROMPT, SAMPLING)  # awake since
    assert [c for c, _ in engine.calls] == ["generate", "sleep", "update_weights", "wake_up", "generate", "generate"]
    assert [state for c, state in engine.calls if c == "update_weights"] == ["asleep"]
    assert again.token_ids == first.token_ids


HELD_OUT = {"name": "held", "source": "reasoning_gym", "task": "chain_sum", "size": 6, "seed": 1}


def config(model, run_dir, engine, **trainer):
    return {
        "model": {"path": model},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 32, "eval": [HELD_OUT]},
        "rollout": {"engine": engine, "n": 4, "max_tokens": 6},
        "rewards": [{"function": "sevens"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.01},
        "trainer": {"steps": 3, "prompts_per_step": 2, "lr": 1e-2, "seed": 0, "threads": 1, "run_dir": str(run_dir)}
        | {"eval_every": 2}
        | trainer,
        "logging": {"loggers": ["jsonl"]},
    }


def training(run_dir) -> list[dict]:
    """metrics.jsonl's rows without what measures time or the sync check (which runs at a resume's first step)."""
    skip = ("timing/", "throughput/", "time", "async/", "rollout/sync_check")
    rows = metrics_rows(run_dir)
    return [{k: v for k, v in r.items() if not k.startswith(skip)} for r in rows]


@pytest.fixture
def registered(register_plugin):
    register_plugin(SevensPlugin(), name="sevens")
    register_plugin(StrictPlugin(), name="strict")


def test_training_with_evaluation_the_sync_check_and_a_resume_keeps_the_engine_lifecycle(
    tiny_model, tmp_path, registered
):
    """Evaluation before training, after step 2 and after the last; the sync check's probes at the
    first step of each run; a resume after step 2. The strict engine drops its weights at each
    sleep: the run trains as one through hf only because each came back whole before a generation."""
    plain = tmp_path / "hf"
    Trainer(build_run(load_config(data=config(tiny_model, plain, "hf")))).train()
    run = tmp_path / "strict"
    first = Trainer(build_run(load_config(data=config(tiny_model, run, "strict", steps=2))))
    first.train()
    resumed = Trainer(build_run(load_config(data=config(tiny_model, run, "strict", resume=True))))
    resumed.train()
    assert training(run) == training(plain)
    # asleep from the end of a step's rollouts to the sync after its update; evaluation and the sync
    # check's probes wake it where it sleeps and leave it awake
    gen, sleep, sync, wake = "generate", "sleep", "update_weights", "wake_up"
    # eval 0, probe + step 1, probe; step 2, eval 2
    assert names(first.run.engine) == [gen, sleep, sync, wake, gen, sleep, sync, wake, gen, "close"]
    # the resume's sync; probe + step 3, probe, eval 3
    assert names(resumed.run.engine) == [sync, gen, sleep, sync, wake, gen, "close"]
    assert {state for c, state in first.run.engine.calls + resumed.run.engine.calls if c == sync} == {"awake", "asleep"}


def test_rollout_async_never_puts_an_engine_apart_to_sleep(tiny_model, tmp_path, registered):
    """The prefetch thread and the loop call the engine through the session, never at once."""
    cfg = config(tiny_model, tmp_path, "strict", eval_every=1)
    cfg["rollout"] |= {"async": 1, "runs_apart": True}
    trainer = Trainer(build_run(load_config(data=cfg)))
    trainer.train()
    assert trainer.prefetch is not None
    assert set(names(trainer.run.engine)) == {"generate", "update_weights", "close"}
