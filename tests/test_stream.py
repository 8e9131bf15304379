"""rollout.stream through the real trainer, with the hf engine behind a stand-in for a server that
takes syncs in flight: each prompt's group is a call of its own, a step trains the first groups to
finish, the engine never holds more than (k + 1) x prompts_per_step of them, and across a checkpoint
every group is trained once, also through a chain of SIGKILLs. The run with a real vLLM server is in
plugins/rollout_vllm/tests/test_server.py."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
import yaml
from hybridrl_testing import SevensPlugin, metrics_rows

from hybridrl.checkpoint import latest_checkpoint, list_checkpoints
from hybridrl.checkpoint_files import read_pt
from hybridrl.components import Environment, Observation, RewardFunction, RolloutEngine
from hybridrl.config import load_config
from hybridrl.errors import ConfigError, Interrupted, StageError
from hybridrl.hookspecs import hookimpl
from hybridrl.run import build_run
from hybridrl.session import rollout_seed
from hybridrl.trainer import Trainer

N, PROMPTS, DEPTH = 2, 2, 1


class Streaming(RolloutEngine):
    """The hf engine as a server that takes syncs in flight would answer: calls from many threads at
    once (one decoding at a time), each token labelled with the syncs the engine had taken when it was
    sampled. The group of the run's first prompt waits for the first sync before it decodes."""

    weight_format = "transformers"
    fails = -1  # the draw whose request fails, as a server that dies would
    outlives: dict[int, int] = {}  # draw -> syncs it waits for, its first token labelled as it started
    after: dict[int, tuple[int, ...]] = {}  # draw -> the draws answered before it (a long response)
    sync_after: tuple[int, ...] = ()  # draws answered before any sync lands, once they have started

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        from hybridrl.builtin.rollout_hf import HFEngine

        self.hf, self.lock, self.syncs = HFEngine(HFEngine.Options(), ctx), threading.Lock(), 0
        self.counting = threading.Lock()  # apart from the decoding's: a call counts as running as it comes in
        self.synced, self.running, self.most = threading.Event(), 0, 0
        self.answered: set[int] = set()
        self.begun: set[int] = set()  # the draws asked for

    draws: dict[tuple[int, ...], int] = {}  # a prompt's ids -> the draw that asked for it, over the runs of a test

    def runs_apart(self):
        return True

    def updates_in_flight(self):
        return True

    def generate(self, prompts, sampling):
        draw = (sampling.seed - rollout_seed(0, 0)) // sampling.n  # the stream seeds draw d as prompt d of step 0
        probe = draw >= 1000  # the sync check's probe: the first prompt, in a round of its own
        with self.counting:
            self.running += 1
            self.most = max(self.most, self.running)
            if not probe:
                self.draws[tuple(prompts[0])] = draw
                self.begun.add(draw)
        started = self.syncs
        if draw == 0 and not self.synced.wait(60):
            raise TimeoutError("no sync")
        while self.syncs < self.outlives.get(draw, 0) or not self.answered.issuperset(self.after.get(draw, ())):
            time.sleep(0.01)
        if draw == self.fails:
            raise ConnectionError("the server closed the connection mid-request")
        with self.lock:
            out = self.hf.generate(prompts, sampling)
            out.token_versions = [[self.syncs] * len(ids) for ids in out.token_ids]
            if draw in self.outlives:  # a response that started before the syncs it waited for
                out.token_versions = [[started] + v[1:] for v in out.token_versions]
        with self.counting:
            self.running -= 1
            self.answered.add(draw)
        return out

    def update_weights(self, named_tensors):
        while not self.answered.issuperset(self.begun.intersection(self.sync_after)):  # started: answered first
            time.sleep(0.01)
        with self.lock:
            self.hf.update_weights(named_tensors)
            self.syncs += 1
        self.synced.set()

    def close(self):
        self.hf.close()


class Draws(RewardFunction):
    """The sevens reward, recording the draws of the groups each step trains (through the engine's map)
    and each group's response tokens."""

    trained: list[list[int]] = []
    tokens: list[list[int]] = []

    def score(self, batch):
        ids = [tuple(p[m.bool()].tolist()) for p, m in zip(batch["prompts"], batch["prompt_mask"], strict=True)]
        self.trained.append(sorted({Streaming.draws[i] for i in ids}))
        self.tokens.append(
            [int(batch["response_mask"][batch["group_ids"] == g].sum()) for g in batch["group_ids"].unique()]
        )
        return [float(str(t).count("7")) for t in batch["response_text"]]


class Twice(Environment):
    """Answers a trajectory's first turn with a user message and ends it at the second."""

    def reset(self, row, messages):
        return {"turn": 0}

    def step(self, state, turn):
        state["turn"] += 1
        return Observation([{"role": "user", "content": "Once more."}], done=state["turn"] >= 2)


class Plugin:
    @hookimpl
    def register_rollout_engines(self, register):
        register("streaming", Streaming)

    @hookimpl
    def register_reward_functions(self, register):
        register("draws", Draws)

    @hookimpl
    def register_environments(self, register):
        register("twice", Twice)


def config(model, run_dir, steps, **rollout):
    return {
        "model": {"path": model},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 64, "shuffle": False},
        "rollout": {"engine": "streaming", "n": N, "max_tokens": 6, "async": DEPTH, "stream": True} | rollout,
        "rewards": [{"function": "draws"}],
        "algorithm": {"name": "grpo", "rollout_correction": "token"},
        "trainer": {"steps": steps, "prompts_per_step": PROMPTS, "lr": 1e-2, "seed": 0, "threads": 1}
        | {"run_dir": str(run_dir), "save_every": 2},
        "logging": {"loggers": ["jsonl"]},
    }


def train(cfg) -> tuple[Trainer, list[dict]]:
    Draws.trained, Draws.tokens = [], []
    trainer = Trainer(build_run(load_config(data=cfg)))
    trainer.train()
    rows = metrics_rows(trainer.run.run_dir)
    return trainer, rows


@pytest.fixture
def registered(register_plugin):
    Streaming.draws.clear()
    register_plugin(Plugin(), name="streaming")
    register_plugin(SevensPlugin(), name="sevens")


def test_a_step_trains_the_first_groups_to_finish_and_the_engine_stays_full(tiny_model, tmp_path, registered):
    trainer, rows = train(config(tiny_model, tmp_path / "run", 4))
    trained = Draws.trained
    assert len(trained) == 4 and all(len(t) == PROMPTS for t in trained)  # one scoring a step: no refill
    # the run's first prompt waited for the first sync: step 1 trained the two that finished first
    assert 0 not in trained[0] and 0 in sum(trained[1:], [])
    flat = sum(trained, [])
    assert len(flat) == len(set(flat))  # no group trained twice
    engine = trainer.run.engine
    assert engine.most <= (DEPTH + 1) * PROMPTS and engine.most >= PROMPTS + 1  # full, never over the bound
    assert all(r["rollout/groups_in_flight"] <= (DEPTH + 1) * PROMPTS for r in rows)
    # generation time is the step's tokens at the engine's rate, not the wait for them (about none)
    assert all(0 < r["async/rollout_s"] and r["throughput/rollout_tokens_per_s"] < 1e5 for r in rows)
    # the first prompt's tokens came after the first sync; each token at most k updates old
    assert all(r["rollout/staleness_max"] <= DEPTH for r in rows) and sum(r["rollout/stale_groups"] for r in rows) == 0
    assert max(Streaming.draws.values()) < 4 * PROMPTS + (DEPTH + 1) * PROMPTS  # nothing started past the bound


def test_a_checkpoint_keeps_the_groups_finished_and_in_flight_and_each_trains_once(
    tiny_model, tmp_path, registered, register_plugin
):
    class StopAfter2:  # as SIGTERM after step 2 would: the checkpoint holds the groups not yet trained
        trainer = None

        @hookimpl
        def on_step_end(self, step):
            if step == 2:
                self.trainer.signals.name = "SIGTERM"

    run_dir = tmp_path / "run"
    stop = register_plugin(StopAfter2(), name="stop-after-2")
    stop.trainer = Trainer(build_run(load_config(data=config(tiny_model, run_dir, 4))))
    Draws.trained = []
    with pytest.raises(Interrupted):
        stop.trainer.train()
    before = sum(Draws.trained, [])
    saved = read_pt(latest_checkpoint(run_dir) / "state.pt")["components"]["prefetch"]
    held = [d for d, _ in saved["finished"]] + [d for d, _ in saved["flying"]]
    # after step 2 took its groups: the k x prompts_per_step left (their replacements start with step 3)
    assert len(held) == DEPTH * PROMPTS and not set(held) & set(before)
    stop.trainer = None
    cfg = config(tiny_model, run_dir, 4)
    cfg["trainer"]["resume"] = True
    train(cfg)
    after = sum(Draws.trained, [])
    # the resumed run trained the held groups (the finished ones as saved, the prompts in flight started
    # again with their seeds) and new ones, none trained twice over the two runs
    assert set(held) <= set(after) and len(after) == len(set(after)) == 2 * PROMPTS and not set(after) & set(before)
    assert set(before) | set(after) == set(range(4 * PROMPTS))  # the first prompts, every one trained once


def test_a_step_of_tokens_takes_the_first_groups_that_hold_them(tiny_model, tmp_path, registered):
    """rollout.step_tokens 30 with groups of two responses of up to 6 tokens: a step takes three groups
    at least (more than prompts_per_step, 2), and more where responses ended early."""
    trainer, rows = train(config(tiny_model, tmp_path / "run", 4, step_tokens=30))
    for tokens in Draws.tokens:  # each step: the fewest first groups that hold 30 tokens
        assert sum(tokens) >= 30 and sum(tokens[:-1]) < 30
    assert [r["rollout/groups"] for r in rows] == [len(t) for t in Draws.tokens]
    flat = sum(Draws.trained, [])
    assert len(flat) == len(set(flat)) and trainer.run.engine.most <= (DEPTH + 1) * PROMPTS
    with pytest.raises(ConfigError, match=r"needs rollout.stream \(it is off\)"):
        Trainer(build_run(load_config(data=config(tiny_model, tmp_path, 2, stream=False, step_tokens=20))))
    with pytest.raises(ConfigError, match=r"rollout.refill_rounds is 2"):
        Trainer(build_run(load_config(data=config(tiny_model, tmp_path, 2, step_tokens=20, refill_rounds=2))))


def test_stream_needs_async_and_an_engine_that_takes_syncs_in_flight(tiny_model, tmp_path, registered):
    with pytest.raises(ConfigError, match=r"rollout.async >= 1 \(it is 0\)"):
        Trainer(build_run(load_config(data=config(tiny_model, tmp_path, 2, **{"async": 0}))))
    with pytest.raises(ConfigError, match="rollout engine 'hf' does not"):
        Trainer(build_run(load_config(data=config(tiny_model, tmp_path, 2, engine="hf"))))


def test_an_agents_groups_stream_turn_by_turn_and_each_trains_once(tiny_model, tmp_path, registered):
    """rollout.agent with rollout.stream: each group's episodes run apart, their turns engine calls of
    their own among the other groups'; a step trains the first groups whose episodes ended."""
    agent = {"environment": "twice", "max_turns": 2, "max_total_tokens": 96}  # turns end at a stop string
    trainer, rows = train(config(tiny_model, tmp_path / "run", 4, agent=agent, stop=["e", "t"], max_tokens=16))
    trained = Draws.trained
    assert len(trained) == 4 and all(len(t) == PROMPTS for t in trained)
    flat = sum(trained, [])
    assert len(flat) == len(set(flat)) and 0 not in trained[0]  # the first group waited for the first sync
    assert all(r["agent/turns_mean"] > 1 and r["agent/observation_tokens_mean"] > 0 for r in rows)
    assert trainer.run.engine.most <= (DEPTH + 1) * PROMPTS  # a call per group's turn, never over the bound
    assert all(r["rollout/staleness_max"] <= DEPTH for r in rows) and rows[0]["rollout/logprob_diff_max"] < 1e-4
    assert all(r["rollout/groups_in_flight"] <= (DEPTH + 1) * PROMPTS for r in rows)
    assert all("rollout/mixed_versions" in r for r in rows)  # each turn's tokens carry their own version


def test_a_group_whose_request_fails_fails_the_step_naming_the_engine(tiny_model, tmp_path, registered, monkeypatch):
    monkeypatch.setattr(Streaming, "fails", 3)
    with pytest.raises(StageError, match=r"rollout engine 'streaming'.*closed the connection mid-request"):
        train(config(tiny_model, tmp_path / "run", 4))


def test_a_group_the_next_step_could_not_train_is_waited_for_and_nothing_is_dropped(
    tiny_model, tmp_path, registered, monkeypatch
):
    """The run's fourth prompt (draw 3) starts at step 1 under the initial weights and answers only after
    the two prompts that step 2 starts (a long response): step 3 could not train it (its first token is
    older than the weights of step 2's start). So step 2 takes it, waiting for it, with draw 0 (also
    started at step 1), rather than the groups that finish first; nothing is dropped."""
    monkeypatch.setattr(Streaming, "after", {3: (4, 5)})
    _, rows = train(config(tiny_model, tmp_path / "run", 4))
    assert Draws.trained[1] == [0, 3]
    assert sum(r["rollout/stale_groups"] for r in rows) == 0 and sum(r["rollout/stale_tokens"] for r in rows) == 0
    trained = sum(Draws.trained, [])
    assert len(trained) == len(set(trained)) == 4 * PROMPTS and set(trained) == set(range(4 * PROMPTS))
    assert all(r["rollout/staleness_max"] <= DEPTH for r in rows)


def test_groups_left_past_the_bound_are_dropped_counted_and_replaced(tiny_model, tmp_path, registered, monkeypatch):
    """rollout.step_tokens 1: a step takes one group, while (k + 1) x prompts_per_step (4) started under
    the initial weights. Step 2 takes one of the three the next step could not train (draws 1-3 and
    draw 0, which started with them); draw 0 sampled only after the first sync, so its tokens are of
    the newer weights, but one of draws 1-3 is left too stale at step 3: dropped there and counted
    (its tokens generated, not trained), and a prompt starts in its place. A step of one group against
    four in flight keeps leaving groups behind: so it goes on at step 4. Nothing older than the bound
    is trained on. Draws 1-3 sample before the first sync lands, however busy the machine (CI once had
    one sample after it, so that none was stale at step 3)."""
    monkeypatch.setattr(Streaming, "sync_after", (1, 2, 3))
    _, rows = train(config(tiny_model, tmp_path / "run", 4, step_tokens=1))
    assert [r["rollout/stale_groups"] for r in rows][:3] == [0, 0, 1]
    assert all(0 < r["rollout/stale_tokens"] <= r["rollout/stale_groups"] * N * 6 for r in rows[2:])
    trained = sum(Draws.trained, [])
    assert len(trained) == len(set(trained)) == 4 and len({1, 2, 3} - set(trained)) == 1
    assert all(r["rollout/staleness_max"] <= DEPTH for r in rows)


def test_a_group_that_sampled_no_token_is_never_late_nor_stale():
    """A finished group whose responses hold no sampled token (each ended at once) has no oldest token:
    the next step can train it, so no step waits for it, and it is not dropped."""
    import torch

    from hybridrl.batch import Batch
    from hybridrl.stream import Streamer, oldest

    empty = Batch({"response_mask": torch.zeros(2, 3), "token_versions": torch.zeros(2, 3, dtype=torch.long)})
    old = Batch({"response_mask": torch.ones(2, 3), "token_versions": torch.zeros(2, 3, dtype=torch.long)})
    streamer = Streamer.__new__(Streamer)
    streamer.step, streamer.depth, streamer.held = 3, 1, {2: 1, 3: 2}
    streamer.finished, streamer.flying = [(7, empty), (8, old)], {9: (0, [1], "x", 1), 10: (0, [1], "x", 2)}
    assert oldest(empty) is None and oldest(old) == 0
    assert streamer._late() == {8, 9}  # started (or sampled) under weights older than step 3's: 2
    assert not streamer._too_stale(empty) and streamer._too_stale(old)  # step 3 trains from step 2's: 1


class OddsTie(Draws):
    """Draws' record, with every response of an odd draw scored the same: dynamic sampling drops those."""

    def score(self, batch):
        super().score(batch)
        ids = [tuple(p[m.bool()].tolist()) for p, m in zip(batch["prompts"], batch["prompt_mask"], strict=True)]
        return [1.0 if Streaming.draws[i] % 2 else float(j % N) for j, i in enumerate(ids)]


def test_refill_rounds_take_the_next_groups_to_finish_for_those_the_filter_dropped(
    tiny_model, tmp_path, registered, register_plugin
):
    class Plugin:
        @hookimpl
        def register_reward_functions(self, register):
            register("odds_tie", OddsTie)

    register_plugin(Plugin(), name="odds-tie")
    cfg = config(tiny_model, tmp_path / "run", 3, refill_rounds=4)
    cfg["rewards"] = [{"function": "odds_tie"}]
    cfg["algorithm"]["dynamic_sampling"] = True
    _, rows = train(cfg)
    # every step kept its prompts_per_step groups, all of even draws, after rounds of the next to finish
    assert all(r["dynamic_sampling/kept_groups"] >= PROMPTS for r in rows)
    assert any(r["rollout/rounds"] > 1 for r in rows)
    scored = sum(Draws.trained, [])
    assert len(scored) == len(set(scored))  # a group is scored once, in the round that took it
    assert sum(1 for d in scored if d % 2 == 0) >= 3 * PROMPTS


# A run of this file's engine that SIGKILLs itself at one point: in a step's rollout (its groups taken
# and scored), in the weight sync after a step's update, in the checkpoint written after a step (the
# stream's state taken, the files not all written), or in on_step_end. Each scoring is logged first
# with the step and the prompts of its groups.
KILLER = """
import importlib.util, json, os, signal, sys
from hybridrl import plugins, stream
from hybridrl.cli import main
from hybridrl.hookspecs import hookimpl

spec = importlib.util.spec_from_file_location("stream_tests", sys.argv[1])
tests = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tests)
where, at, log, now = sys.argv[2], int(sys.argv[3]), sys.argv[4], [0]

def kill(point, step):
    if point == where and step == at:
        os.kill(os.getpid(), signal.SIGKILL)

class Logged(tests.Draws):
    def score(self, batch):
        prompts = sorted({tuple(p[m.bool()].tolist()) for p, m in zip(batch["prompts"], batch["prompt_mask"])})
        with open(log, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "step": now[0], "prompts": prompts}) + "\\n")
        kill("rollout", now[0])
        return [0.0] * len(batch)

class Killer:
    @hookimpl
    def register_reward_functions(self, register):
        register("logged", Logged)

    @hookimpl
    def on_train_start(self, start_step):
        now[0] = start_step + 1

    @hookimpl
    def on_step_end(self, step):
        kill("step_end", step)
        now[0] = step + 1

sync, state = tests.Streaming.update_weights, stream.Streamer.state_dict
tests.Streaming.update_weights = lambda self, named: (kill("sync", now[0]), sync(self, named))[1]
stream.Streamer.state_dict = lambda self: (state(self), kill("checkpoint", now[0] - 1))[0]
plugins.get_plugin_manager().register(tests.Plugin(), name="streaming")
plugins.get_plugin_manager().register(Killer(), name="killer")
sys.exit(main(["train", sys.argv[5], "--resume"]))
"""
KILLS = [("rollout", 1), ("sync", 2), ("checkpoint", 2), ("step_end", 3)]
KILLS += [("rollout", 4), ("sync", 5), ("checkpoint", 6), ("step_end", 7)]


def test_killed_at_eight_points_each_resume_trains_every_group_once(tiny_model, tmp_path):
    """Eight SIGKILLs in one run of 8 steps (checkpoints every 2), each resumed from the last intact
    checkpoint: the steps the run kept (the last process to train each) trained 2 groups each, none
    twice, and no prompt drawn was lost; what a killed process trained after its last checkpoint is
    trained again after the resume, by the run's rule (the checkpoint's finished groups as saved, its
    prompts in flight started again with their own seeds)."""
    cfg = config(tiny_model, tmp_path / "run", 8)
    cfg["rewards"], cfg["trainer"]["save_every"] = [{"function": "logged"}], 2
    path, log = tmp_path / "cfg.yaml", tmp_path / "trained.jsonl"
    path.write_text(yaml.safe_dump(cfg))
    for where, at in [*KILLS, ("nowhere", 0)]:
        args = [sys.executable, "-c", KILLER, __file__, where, str(at), str(log), str(path)]
        out = subprocess.run(args, capture_output=True, text=True, timeout=300)
        assert out.returncode == (0 if where == "nowhere" else -9), (where, at, out.stderr[-3000:])
    scored = [json.loads(line) for line in log.read_text().splitlines()]
    kept = {e["step"]: e["prompts"] for e in scored}  # a later process's step replaces a killed one's
    assert sorted(kept) == list(range(1, 9)) and len(scored) > 8  # some steps were trained again
    trained = [tuple(p) for step in sorted(kept) for p in kept[step]]
    assert len(trained) == len(set(trained)) == 8 * PROMPTS  # every kept group once
    # nothing started was lost: at each checkpoint kept, every prompt drawn was trained or is held, and
    # the run ends with none left (the last steps start only the prompts they need)
    for checkpoint in list_checkpoints(tmp_path / "run"):
        saved = read_pt(checkpoint / "state.pt")["components"]["prefetch"]
        step, held = int(checkpoint.name.split("-")[1]), len(saved["finished"]) + len(saved["flying"])
        assert saved["draws"] == step * PROMPTS + held and held == (0 if step == 8 else DEPTH * PROMPTS)
