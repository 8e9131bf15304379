"""The engine session: the one owner of the rollout engine.

Everything that needs the engine goes through one :class:`EngineSession`: the loop's rollouts,
the prefetch thread's (``rollout.async``), the agent loop's turns, ``hybridrl serve``'s answers,
the sync check's probe; and so do its weight syncs, its figures and its release. The session

- serialises access: one engine call at a time, whatever thread makes it;
- alone decides when the engine sleeps and wakes, and makes every call in the state the engine's
  lifecycle allows (:class:`hybridrl.components.RolloutEngine`): :meth:`EngineSession.generate`
  wakes a sleeping engine first, :meth:`EngineSession.before_training` puts it to sleep, and an
  engine put to sleep is woken only after a weight sync. Its callers never wake or sleep it;
- counts the policy version: ``updates`` (weight syncs of policy updates sent) and ``version``
  (the updates the engine's weights hold: fewer for a server that syncs every few updates), both
  changed under the lock of the sync, and stamped on each generation under the lock of that
  generation (``RolloutOutput.policy_version``): an answer never carries a version older than the
  weights that sampled it. An engine that updates in flight (``updates_in_flight``) generates
  outside that lock, so a sync may land during a call; its answer then carries the version it
  started with and, per token, the version that sampled it (``token_versions``);
- seeds each call by one rule (:func:`rollout_seed`): prompt p of a step, over all ranks, is
  seeded ``base + p·n`` (engines that seed each request give its sample j ``+ j``:
  :meth:`hybridrl.components.SamplingParams.sample_seeds`);
- checks that the engine computes with the trainer's weights (:class:`SyncCheck`);
- turns an engine's out-of-memory error into one that names the engine's own memory options
  (:meth:`hybridrl.components.RolloutEngine.memory_options`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import torch

from hybridrl import distributed
from hybridrl import functional as F
from hybridrl.batch import Batch
from hybridrl.components import RolloutEngine, RolloutOutput, Sampling, SamplingParams
from hybridrl.errors import StageError, stage_errors
from hybridrl.memory import memory_errors

SYNC_CHECK_FACTOR = 20  # after syncs, allow this many times the difference measured before the first
PROBE_ROUND = 7  # the sync check's probe draws its own samples: a round no step reaches
# evaluation set i (hybridrl.evaluation) draws round EVAL_ROUND + i of step 0, far from any step's rounds:
# the same samples at every evaluation, so that two evaluations differ by the weights alone
EVAL_ROUND = 1_000


def rollout_seed(seed: int, step: int, round_: int = 0, first_prompt: int = 0, n: int = 1) -> int:
    """The sampling seed of a call whose first prompt is the step's prompt ``first_prompt``.

    Engines that seed each request (vllm, sglang) give prompt i of a call ``seed + i·n`` and its
    sample j ``+ j``; with this rank's first prompt at ``first_prompt`` of the step, prompt p of
    the step (over all ranks) is seeded ``base + p·n``, so a run samples the same responses on
    any number of ranks. Rounds of a step draw other samples.
    """
    return seed * 100_003 + step + 10_000_019 * round_ + first_prompt * n


class EngineSession:
    """The rollout engine of a run, and everything about it that outlives one call."""

    def __init__(self, engine: RolloutEngine, rollout, seed: int = 0, prompts_per_step: int = 1, pad_id: int = 0):
        """``rollout``: the config's rollout section; ``seed``, ``prompts_per_step``: the trainer's."""
        self.engine, self.rollout, self.seed, self.pad_id = engine, rollout, seed, pad_id
        self.prompts_per_step = prompts_per_step
        self.component = f"rollout engine '{rollout.engine}'"
        self.lock = threading.RLock()  # one engine call at a time
        self.updates = 0  # policy updates sent to the engine
        self.version = 0  # the updates the engine's weights hold
        self.asleep = False  # engines are built awake
        self.holds_weights = True  # False from a sleep (which may drop them) to the next weight sync
        self.adapters = False  # syncs send the LoRA adapter alone (hybridrl.lora.choose_sync)
        self.adapter: str | None = None  # the named adapter that syncs send and calls that name none use
        self.named: dict = {}  # the latest adapter sent under each name (hybridrl.lora.Adapter)
        self.holding: str | None = None  # the named adapter an engine of one adapter at a time holds
        self.loaded = [0]  # the version the engine held after each of its syncs (0: before the first)
        self.check = SyncCheck(self)

    # -- sampling ---------------------------------------------------------------------------

    def sampling(self, step: int, round_: int = 0, **changes) -> SamplingParams:
        """What the engine samples with: the rollout section of the config, ``changes`` applied, and
        the seed of this rank's first prompt of the step's round (:func:`rollout_seed`)."""
        first = distributed.rank() * (self.prompts_per_step // distributed.world_size())
        keys = self.rollout.model_dump(include=set(Sampling.model_fields)) | changes
        return SamplingParams(**keys, seed=rollout_seed(self.seed, step, round_, first, keys["n"]))

    def seeds_each_request(self) -> bool:
        return self.engine.seeds_each_request()

    def runs_apart(self) -> bool:
        return self.engine.runs_apart()

    # -- calls ------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, what: str = "generate") -> RolloutOutput:
        """The engine's responses to ``prompts``, stamped with the policy version that sampled them;
        a sleeping engine is woken first, and left awake."""
        if self.adapters and self.adapter is not None and sampling.adapters is None:
            sampling = sampling.model_copy(update={"adapters": [self.adapter] * len(prompts)})
        with self.lock:
            self._wake()
            version, in_flight = self.version, self.updates_in_flight()
            if not in_flight:
                out = self._generate(prompts, sampling, what)
        if in_flight:  # a sync may land meanwhile: the tokens say which weights sampled them
            out = self._generate(prompts, sampling, what)
        out.policy_version = version
        if out.token_versions is not None:
            with self.lock:  # after a sync that a token's weights came from has counted its version
                out.token_versions = [[self._loaded(k) for k in row] for row in out.token_versions]
        return out

    def _generate(self, prompts: list[list[int]], sampling: SamplingParams, what: str) -> RolloutOutput:
        names = set(sampling.adapters or ())
        most = self.engine.adapters_per_call() if names else 0  # asked only of calls that name adapters (tenants)
        if names and ((most == 1 and names - {self.holding}) or len(names) > most):
            return self._in_parts(prompts, sampling, what, most)
        with stage_errors(self.component, what), self._memory_errors(prompts, sampling):
            return self.engine.generate(prompts, sampling)

    def _in_parts(self, prompts: list[list[int]], sampling: SamplingParams, what: str, most: int) -> RolloutOutput:
        """A call whose prompts name more adapters than the engine mixes (``most``): a call for the prompts of
        each ``most`` of them in turn, each seeded as in the whole call (an engine that holds one adapter is
        sent each first); the answers in the prompts' order."""
        seeds, order = sampling.prompt_seeds(len(prompts)), {}
        for i, name in enumerate(sampling.adapters):
            order.setdefault(name, []).append(i)
        names, parts = list(order), []
        for group in (names[k : k + most] for k in range(0, len(names), most)):
            if most == 1 and group[0] != self.holding:
                with stage_errors(self.component, f"update_adapter ({group[0]})"):
                    self.engine.update_adapter(self.named[group[0]])
                self.holding = group[0]
            rows = sorted(i for name in group for i in order[name])
            own = [seeds[i] for i in rows] if seeds is not None else None
            update = {"adapters": [sampling.adapters[i] for i in rows], "seed": None, "seeds": own}
            parts.append((rows, self._generate([prompts[i] for i in rows], sampling.model_copy(update=update), what)))
        return merged_output(parts, len(prompts), sampling.n)

    def _loaded(self, syncs: int) -> int:
        """The policy version of the weights an engine held after ``syncs`` of its syncs."""
        if not 0 <= syncs < len(self.loaded):
            raise StageError(
                f"{self.component}: a token was sampled by the weights of sync {syncs}, but the engine has had "
                f"{len(self.loaded) - 1} syncs from this run: its version counter is not this run's (another "
                "trainer syncing the same server?). Nothing is trained on tokens of unknown weights."
            )
        return self.loaded[syncs]

    def updates_in_flight(self) -> bool:
        """Whether a sync may land while the engine generates (:meth:`RolloutEngine.updates_in_flight`)."""
        return self.engine.updates_in_flight()

    def before_training(self) -> None:
        """Training comes next (the loop's rollouts are done): the engine sleeps, giving its memory to
        the update, until the next :meth:`generate` wakes it, after the weight sync."""
        with self.lock:
            if self.asleep:
                return
            with stage_errors(self.component, "sleep"):
                self.engine.sleep()
            self.asleep, self.holds_weights = True, False

    def _wake(self) -> None:
        """Wake a sleeping engine: only once it has weights again (its sleep may have dropped them)."""
        if not self.asleep:
            return
        if not self.holds_weights:
            raise StageError(
                f"{self.component}: asked to generate while asleep, before any weight sync since it went to "
                "sleep; its sleep may have dropped the weights (vLLM's sleep_level 2), so the engine session "
                "wakes it only after one (RolloutEngine's lifecycle). Generate before "
                "EngineSession.before_training(), or after the sync that follows training."
            )
        with stage_errors(self.component, "wake_up"):
            self.engine.wake_up()
        self.asleep = False

    def sync(self, tensors, update: bool = True) -> None:
        """Send the policy's weights (``tensors``: named tensors, or a callable that yields them once
        the engine is free; with :attr:`adapters`, the callable gives a :class:`hybridrl.lora.Adapter`),
        in the state the engine is in (asleep after training: it loads the weights alone). ``update``:
        they hold one more policy update (a resume's or a check's resync sends the same weights again)."""
        call = "update_adapter" if self.adapters else "update_weights"
        with self.lock, stage_errors(self.component, call):
            weights = tensors() if callable(tensors) else tensors
            if self.adapters and self.adapter is not None:  # a named adapter (a tenant's), kept for later calls
                weights = self.named[self.adapter] = dataclasses.replace(weights, name=self.adapter)
                self.holding = self.adapter
            getattr(self.engine, call)(weights)
            self.holds_weights = True
            if update:
                self.updates += 1
                if self.engine.holds_latest_weights():
                    self.version = self.updates
            self.loaded.append(self.version)

    def metrics(self) -> dict[str, float]:
        with self.lock:
            return self.engine.metrics()

    def close(self) -> None:
        with self.lock:
            self.engine.close()

    def state_dict(self) -> dict:
        return {"updates": self.updates, "version": self.version}

    def load_state_dict(self, state: dict) -> None:
        self.updates, self.version = int(state["updates"]), int(state["version"])
        self.loaded[-1] = self.version  # what the engine is taken to hold until the resume's sync

    @contextlib.contextmanager
    def _memory_errors(self, prompts: list[list[int]], sampling: SamplingParams):
        """Out of memory while generating: an error naming the engine, the sizes and its memory options."""
        try:
            yield
        except torch.OutOfMemoryError:
            longest = max(map(len, prompts), default=0)
            sizes = f"{len(prompts)} prompts x {sampling.n} samples of up to {longest} + {sampling.max_tokens} tokens"
            device = getattr(getattr(self.engine, "ctx", None), "device", torch.device("cpu"))
            fix = f"Lower {self.engine.memory_options(max(1, len(prompts) // 2))}, or rollout.max_tokens."
            with memory_errors(f"{self.component} generate", device, sizes, fix):
                raise


class SyncCheck:
    """Whether the engine computes with the trainer's weights: the engine samples one token a few
    times for a probe prompt, and the policy scores them (``rollout.sync_check``)."""

    def __init__(self, session: EngineSession):
        self.session, self.rollout = session, session.rollout
        self.allowed = self.rollout.sync_check
        self.means: list[float] = []  # each rank's difference of the latest probe

    def enabled(self) -> bool:
        return bool(self.rollout.sync_check) and self.session.engine.holds_latest_weights()

    @torch.no_grad()
    def probe(self, prompt: list[int], step: int, policy_logprobs, samples: int = 8) -> float:
        """The engine samples one token ``samples`` times for ``prompt``; returns the largest, over
        ranks, mean |engine logprob - ``policy_logprobs(batch)``| of those tokens."""
        s = self.session
        keys = self.rollout.model_dump(include={"temperature", "top_p", "top_k"})
        seed = rollout_seed(s.seed, step, PROBE_ROUND)  # the same on every rank
        out = s.generate([prompt], SamplingParams(**keys, n=samples, max_tokens=1, seed=seed), "generate (sync check)")
        batch = Batch.from_rollout([prompt], out, samples, s.pad_id)
        lp = policy_logprobs(batch)
        diff = (lp - batch["rollout_logprobs"].to(lp.device)).abs()
        self.means = distributed.all_gather_objects(float(F.masked_mean(diff, batch["response_mask"].to(lp.device))))
        return max(self.means)

    def start(self, prompt, step: int, policy_logprobs, resumed: bool, resync) -> tuple[dict[str, float], str | None]:
        """Before the run's first update, when the engine should hold the policy's own weights: the
        difference the engine's precision and conventions give (the baseline), the metrics, and an
        error message when it is above ``rollout.sync_check``. An engine that started from other
        weights (a server left by another run) is sent the policy's (``resync()``) and probed again.
        Later checks allow ``max(rollout.sync_check, SYNC_CHECK_FACTOR x baseline)``."""
        r = self.rollout
        if not self.enabled():
            return {}, None
        base = first = self.probe(prompt, step, policy_logprobs)
        if first > r.sync_check and not resumed:  # resumed: the engine took the checkpoint's weights already
            resync()
            base = self.probe(prompt, step, policy_logprobs)
        self.allowed = max(r.sync_check, SYNC_CHECK_FACTOR * base)
        metrics = {"rollout/sync_check_start": first, "rollout/sync_check_baseline": base}
        metrics["rollout/sync_check_allowed"] = self.allowed
        if base <= r.sync_check:
            return metrics, None
        if resumed:
            return metrics, self._error(step, base, r.sync_check, "at resume")
        ranks = [i for i, d in enumerate(self.means) if d > r.sync_check]
        return metrics, (
            f"{self.session.component} on rank(s) {ranks}: before the first update, holding the policy's own weights "
            f"(as loaded, and sent once more), its logprobs of a probe prompt differ from the policy's by {base:.3g} "
            f"on average (rollout.sync_check allows {r.sync_check:g}). The weights are the same on both sides: the "
            "engine computes logprobs another way than the trainer, which scores each sampled token at its own "
            "position under softmax(logits / temperature) over the whole vocabulary, in the policy's precision. "
            "Check the engine's logprobs (temperature applied, no offset, not truncated), its dtype, or the model's "
            "support in the engine (or, for a server, that it takes weights at all); for an engine of lower "
            "precision raise rollout.sync_check. Step 1's metrics are in metrics.jsonl."
        )

    def after_sync(self, prompt, step: int, policy_logprobs, first: bool = True) -> dict[str, float]:
        """After a weight sync: the probe of :meth:`probe`, whose difference above the allowed one
        (see :meth:`start`) is an error naming the ranks. It runs after the ``first`` sync of a run
        and then every ``rollout.sync_check_every`` steps."""
        r = self.rollout
        due = first or (r.sync_check_every > 0 and step % r.sync_check_every == 0)
        if not due or not self.enabled():
            return {}
        worst = self.probe(prompt, step, policy_logprobs)
        if worst > self.allowed:
            raise StageError(self._error(step, worst, self.allowed, f"after the weight sync of step {step}"))
        return {"rollout/sync_check_diff_max": worst}

    def _error(self, step: int, worst: float, tol: float, when: str) -> str:
        ranks = [i for i, d in enumerate(self.means) if d > tol]
        return (
            f"{self.session.component} on rank(s) {ranks}: {when} its logprobs of a probe prompt differ from the "
            f"policy's by {worst:.3g} on average (allowed: {tol:.3g}, from rollout.sync_check and the difference "
            "before the first sync): the engine does not compute with the trainer's weights. A sync that did not "
            "reach it, weights released by sleep() and never reloaded, or tensors it loads under other names or "
            "layouts; set rollout.sync_check: 0 to skip this check."
        )


def merged_output(parts: list[tuple[list[int], RolloutOutput]], prompts: int, n: int) -> RolloutOutput:
    """One call's answers from those of calls over parts of its prompts (each part: the prompts' places
    in the call, and its answers), in the call's order."""
    rows: list = [None] * (prompts * n)
    for places, out in parts:
        for k, i in enumerate(places):
            for j in range(n):
                rows[i * n + j] = (out, k * n + j)
    column = lambda name: [getattr(o, name)[r] for o, r in rows]  # noqa: E731
    out = RolloutOutput(column("token_ids"), column("logprobs"), column("finish_reasons"))
    for name in ("sampled_masks", "token_versions"):
        if all(getattr(o, name) is not None for _, o in parts):
            setattr(out, name, column(name))
    return out
