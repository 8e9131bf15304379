"""Streamed rollout (``rollout.stream``): every prompt's group is an engine call of its own, a new
prompt starts as soon as one finishes, and a step trains the first groups to finish.

With ``rollout.async: k`` and an engine that takes syncs in flight, each step starts with ``(k + 1) x
trainer.prompts_per_step`` groups started and not yet trained: the step trains the first of them to
finish while the engine goes on with the rest, and the prompts that replace them start with the next
step, under the weights of this one's update. So the engine stays full while the long responses
finish, under newer weights, each token recording the version that sampled it, and no token is more
than k updates old unless its response outlived k syncs. The rules that keep it exact:

- the d-th prompt the run draws is seeded as prompt d of step 0 (:func:`hybridrl.session.rollout_seed`):
  its samples do not depend on when it runs;
- a step takes groups in the order they finish, ``prompts_per_step`` at a time (with
  ``rollout.step_tokens``, until their responses hold that many tokens), through the same rewards,
  filter and refill rounds as a step's own rollout (:meth:`hybridrl.trainer.Trainer.collect`);
- a group whose oldest token is older than the weights the engine held when the step k steps
  back started (what a batch of ``rollout.async`` may hold: k updates, or with a server that reloads
  every m updates k + m - 1) is too stale to train. So a step first takes the groups the next step
  could not (those that started under weights older than the floor of the next step), waiting for
  those still running, and then the first to finish: no generated token is thrown away. Only
  where more such groups are left than a step takes are the rest dropped at the next step, counted
  in ``rollout/stale_groups`` (their tokens in ``rollout/stale_tokens``: generated, not trained),
  and prompts started in their place (so does a refill round, for the groups the filter dropped).
  Weights that never change (a frozen server) make nothing stale;
- a checkpoint keeps the groups finished and not yet trained whole, and the prompts of the groups
  in flight, which a resumed run starts again with their own seeds (their partial responses are
  not kept): every group is trained exactly once.
"""

from __future__ import annotations

import queue
import sys
import threading
import time

import torch

from hybridrl import distributed
from hybridrl.batch import Batch
from hybridrl.errors import ConfigError
from hybridrl.metrics import Timer
from hybridrl.prefetch import Prefetcher, pack, staleness, unpack
from hybridrl.session import rollout_seed


class Streamer:
    """``collect(step, timer, groups)`` (the trainer's) fed by groups streamed from the engine session."""

    def __init__(self, collect, depth: int, last_step: int, stage, prompts_per_step: int, seed: int):
        self.collect, self.depth, self.last_step, self.stage, self.seed = collect, depth, last_step, stage, seed
        self.session, self.size, self.tokens = stage.session, prompts_per_step, stage.config.rollout.step_tokens
        self.done: queue.Queue = queue.Queue()  # (draw, answer or the error raised) as groups finish
        self.flying: dict[int, tuple[int, list[int], str, int]] = {}  # draw -> (row, prompt ids, text, version)
        self.finished: list[tuple[int, Batch]] = []  # finished, not yet trained: received or restored
        self.restart: list[tuple[int, int]] = []  # (draw, row index) in flight at the checkpoint resumed from
        self.draws, self.dropped, self.budget = 0, [], 0  # dropped: the stale groups' tokens; budget: prompts to start
        self.step, self.held = 0, {}  # step -> the engine's version as it started
        self.window = [0, None]  # response tokens finished since the last step took its groups, and since when

    # -- the trainer's side -------------------------------------------------------------------

    def take(self, step: int) -> tuple[Batch, Batch, dict[str, float]]:
        """Step ``step``'s rollout, kept groups and metrics, from the first groups to finish."""
        timer, self.dropped, self.step = Timer(), [], step
        self.held = {s: v for s, v in self.held.items() if s >= step - self.depth} | {step: self.session.version}
        self.budget = (self.depth + 1) * self.size - len(self.flying) - len(self.finished)
        rollout, kept, metrics = self.collect(step, timer, self.groups)
        metrics |= {"async/reward_s": timer.times.get("reward", 0.0), "async/rollout_s": self._engine_seconds(rollout)}
        metrics |= {"rollout/stale_groups": float(len(self.dropped)), "rollout/stale_tokens": float(sum(self.dropped))}
        metrics["rollout/groups_in_flight"] = float(len(self.flying))
        metrics["rollout/groups"] = float(rollout.groups())
        return rollout, kept, metrics | staleness(rollout, self.session.updates)

    def _engine_seconds(self, rollout: Batch) -> float:
        """The seconds the step's tokens took at the rate the engine finished tokens since the last step
        (its groups overlap others: no one call's time is theirs)."""
        while self._receive(block=False):
            pass
        now, (tokens, since) = time.perf_counter(), self.window
        self.window = [0, now]
        rate = tokens / (now - since) if tokens and since is not None and now > since else 0.0
        return float(rollout["response_mask"].sum()) / rate if rate else 0.0

    def groups(self, step: int, round_: int = 0) -> Batch:
        """The next groups to finish that are fresh enough, ``prompts_per_step`` of them or those that make
        ``rollout.step_tokens``, numbered by ``round_``."""
        taken: list[Batch] = []
        self.budget += self.size if round_ else 0  # a refill round: the groups the filter dropped
        while not self._full(taken):
            if not self.flying and not self.finished:  # a step of tokens that outgrew the groups started
                self.budget = max(self.budget, 1)
            self._fill(step, max(1, self.size - len(taken)))
            group = self._next()
            if self._too_stale(group):
                self.dropped.append(int(group["response_mask"].sum()))  # generated, not trained
                self.stage.release(group)
                self.budget += 1
                continue
            taken.append(group)
        batch = Batch.cat(taken, self.stage.pad_id)
        batch["group_ids"] = torch.arange(len(batch)) // self.stage.config.rollout.n + round_ * self.size
        return batch

    def _full(self, taken: list[Batch]) -> bool:
        if self.tokens is None:
            return len(taken) >= self.size
        return sum(int(group["response_mask"].sum()) for group in taken) >= self.tokens

    def before_sync(self) -> None:
        """Nothing waits: the groups in flight go on under the new weights."""

    # -- groups ---------------------------------------------------------------------------------

    def _fill(self, step: int, wanted: int) -> None:
        """Start the prompts this step may start (``budget``), as many as the rest of the run can use."""
        needed = (self.last_step - step) * self.size + wanted
        self.window[1] = self.window[1] or time.perf_counter()
        while self.budget > 0 and len(self.flying) + len(self.finished) < needed:
            draw, index = self.restart.pop(0) if self.restart else (self.draws, self.stage.order.take(1)[0])
            self.draws, self.budget = max(self.draws, draw + 1), self.budget - 1
            self._start(draw, index)

    def _start(self, draw: int, index: int) -> None:
        row = self.stage.data[index]
        (ids,), (text,) = self.stage.encode([row])  # tokenised here, not in the threads
        self.flying[draw] = (index, ids, text, self.session.version)  # its tokens' versions: this or newer
        sampling = self.session.sampling(0)
        sampling = sampling.model_copy(update={"seed": rollout_seed(self.seed, 0, 0, draw, sampling.n)})
        work = self._episodes if self.stage.agent is not None else self._generate
        thread = threading.Thread(target=work, args=(draw, row, ids, sampling), name=f"hybridrl-group-{draw}")
        thread.daemon = True  # a run that ends leaves the groups it has no use for
        thread.start()

    def _generate(self, draw: int, row: dict, ids: list[int], sampling) -> None:
        try:
            self.done.put((draw, self.session.generate([ids], sampling)))
        except BaseException as e:  # raised on the trainer's thread, which takes it
            self.done.put((draw, e))

    def _episodes(self, draw: int, row: dict, ids: list[int], sampling) -> None:
        """An agent's group: its n trajectories, turn by turn through the engine session, as a batch
        whose version is the engine's as the group started (the oldest of its tokens')."""
        try:
            version = self.session.version
            group = self.stage.respond([row], sampling, train=True)
            group["policy_version"] = torch.full((len(group),), version, dtype=torch.long)
            self.done.put((draw, group))
        except BaseException as e:
            self.done.put((draw, e))

    def _receive(self, block: bool) -> bool:
        """One finished group into ``finished`` (False: none finished, without ``block``)."""
        try:
            draw, out = self.done.get(block=block)
        except queue.Empty:
            return False
        if isinstance(out, BaseException):
            raise out
        index, ids, text, _ = self.flying.pop(draw)
        if isinstance(out, Batch):  # an agent's group (its response_mask: the tokens the engine sampled)
            group = out
            self.window[0] += int(group["response_mask"].sum())
        else:
            self.window[0] += sum(map(len, out.token_ids))
            group = self.stage.answered([self.stage.data[index]], [ids], [text], out, len(out.token_ids))
            group["policy_version"] = torch.full((len(group),), out.policy_version, dtype=torch.long)
        self.finished.append((draw, group))
        return True

    def _next(self) -> Batch:
        """The group the step takes next: one the next step could not train (waited for while it runs),
        else the first to finish."""
        late = self._late()
        while late and not any(draw in late for draw, _ in self.finished):
            self._receive(block=True)
        if not self.finished:
            self._receive(block=True)
        first = next((i for i, (draw, _) in enumerate(self.finished) if draw in late), 0)
        return self.finished.pop(first)[1]

    def _late(self) -> set[int]:
        """The draws, finished or running, that started under weights older than the next step's floor."""
        floor = self.held.get(self.step + 1 - self.depth)
        if floor is None:
            return set()
        firsts = {draw: oldest(group) for draw, group in self.finished}  # None: it sampled no token
        late = {draw for draw, first in firsts.items() if first is not None and first < floor}
        return late | {draw for draw, (_, _, _, version) in self.flying.items() if version < floor}

    def _too_stale(self, group: Batch) -> bool:
        floor, first = self.held.get(self.step - self.depth), oldest(group)
        return floor is not None and first is not None and first < floor

    # -- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The groups finished and not yet trained, whole, and the prompts of those in flight."""
        while self._receive(block=False):
            pass
        return {
            "stream": True,
            "draws": self.draws,
            "finished": [(draw, pack(group)) for draw, group in self.finished],
            "flying": [(draw, index) for draw, (index, *_) in sorted(self.flying.items())],
            "held": dict(self.held),
        }

    def load_state_dict(self, state: dict) -> None:
        if not state.get("stream"):
            raise ValueError(
                "the checkpoint's rollout was not streamed (rollout.stream was off when it was saved): resume "
                "with the setting it was saved with."
            )
        self.draws, self.finished = state["draws"], [(d, unpack(g)) for d, g in state["finished"]]
        self.restart, self.held = [tuple(x) for x in state["flying"]], dict(state["held"])

    def close(self) -> None:
        """The groups still in flight are left to finish on their own (their threads end with the run)."""


def oldest(group: Batch) -> int | None:
    """The version of a group's oldest sampled token (None: it sampled none)."""
    versions = group["token_versions"] if "token_versions" in group else group["policy_version"][:, None]
    mask = group["response_mask"].bool() if "token_versions" in group else torch.ones_like(versions, dtype=bool)
    return versions[mask].min().item() if mask.any().item() else None


def make_prefetcher(run, collect) -> Prefetcher | None:
    """The prefetcher of ``rollout.async`` (None when it is 0, or when the engine shares the trainer's
    device and process, which it says once), or with ``rollout.stream`` the streamer (:mod:`hybridrl.stream`)."""
    config, session = run.config, run.session
    depth, stream = config.rollout.async_, config.rollout.stream
    if stream and not (depth and session.updates_in_flight()):
        raise ConfigError(
            "rollout.stream starts each prompt's group as others finish, while the policy trains and syncs: it needs "
            f"rollout.async >= 1 (it is {depth}) and an engine that takes syncs in flight (rollout engine "
            f"'{config.rollout.engine}' {'does' if session.updates_in_flight() else 'does not'}: the vllm or sglang "
            "server with in_flight, docs/async.md)."
        )
    if config.rollout.step_tokens and (not stream or config.rollout.refill_rounds):
        raise ConfigError(
            "rollout.step_tokens sizes a streamed step by its tokens: it needs rollout.stream (it is "
            f"{'on' if stream else 'off'}) and no refill rounds (rollout.refill_rounds is "
            f"{config.rollout.refill_rounds}: they keep groups by count)."
        )
    if not depth:
        return None
    if distributed.world_size() > 1:
        raise ConfigError("rollout.async runs on one process for now; under torchrun set rollout.async: 0.")
    if not session.runs_apart():
        if run.ctx.is_main:
            print(
                f"note: rollout.async={depth}, but rollout engine '{config.rollout.engine}' generates on the "
                "trainer's own device and process, so it cannot generate while the policy trains: running "
                "synchronously. Use a server (rollout.base_url) or an engine on other devices.",
                file=sys.stderr,
                flush=True,
            )
        return None
    if stream:
        t = config.trainer
        return Streamer(collect, depth, t.steps, run.rollout, t.prompts_per_step, t.seed)
    return Prefetcher(collect, depth, config.trainer.steps, session)
