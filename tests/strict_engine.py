"""A rollout engine for tests of the engine's callers, held to the engine lifecycle of
:class:`hybridrl.components.RolloutEngine` (which call comes in which state, asleep or awake).

``StrictEngine`` is the hf engine that records every call and raises :class:`LifecycleError` on
one out of order; ``StrictPlugin`` registers it as ``strict``:
``register_plugin(StrictPlugin(), name="strict")`` with the ``register_plugin`` fixture of
:mod:`hybridrl_testing`. ``tests/test_session.py`` trains through it.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from pydantic import Field

from hybridrl.components import Options, RolloutEngine
from hybridrl.hookspecs import hookimpl


class LifecycleError(RuntimeError):
    """A call that the engine lifecycle (:class:`hybridrl.components.RolloutEngine`) does not allow."""


class StrictEngine(RolloutEngine):
    """The hf engine held to the lifecycle of :class:`hybridrl.components.RolloutEngine`, for tests of
    its callers. It records each call with the state it came in (``calls``: ``(name, state)``) and
    raises :class:`LifecycleError` on one out of order: ``generate`` or ``sleep`` asleep, ``wake_up``
    awake, ``wake_up`` before every weight came back after a sleep, two calls at once, any call
    after ``close``. Its ``sleep`` drops the weights (zeroes them; vLLM's sleep_level 2 discards
    them), so a run through it trains as one through ``hf`` only where the callers keep the order.
    Option ``runs_apart``: it says it runs apart from training (``rollout.async`` then prefetches
    with it)."""

    weight_format = "transformers"  # the hf engine's

    class Options(Options):
        runs_apart: bool = Field(False, description="Say the engine runs apart from training.")

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        from hybridrl.builtin.rollout_hf import HFEngine

        self.hf = HFEngine(HFEngine.Options(), ctx)
        self.state = "awake"  # awake, asleep or closed
        self.dropped: set[str] = set()  # weights dropped by sleep and not sent since
        self.calls: list[tuple[str, str]] = []
        self._busy = threading.Lock()

    @contextlib.contextmanager
    def _call(self, name: str, *allowed: str):
        if not self._busy.acquire(blocking=False):
            raise LifecycleError(f"{name} while another call runs: the engine session makes one call at a time")
        try:
            self.calls.append((name, self.state))
            if self.state not in allowed:
                only = " or ".join(allowed)
                raise LifecycleError(f"{name} while {self.state}: the engine lifecycle allows it {only} only")
            yield
        finally:
            self._busy.release()

    def generate(self, prompts, sampling):
        with self._call("generate", "awake"):
            return self.hf.generate(prompts, sampling)

    def update_weights(self, named_tensors):
        with self._call("update_weights", "awake", "asleep"):
            named_tensors = list(named_tensors)
            self.hf.update_weights(named_tensors)
            self.dropped -= {name for name, _ in named_tensors}

    @torch.no_grad()
    def sleep(self):
        with self._call("sleep", "awake"):
            for p in self.hf.model.parameters():
                p.zero_()
            self.dropped = set(self.hf.model.state_dict())
            self.state = "asleep"

    def wake_up(self):
        with self._call("wake_up", "asleep"):
            if self.dropped:
                raise LifecycleError(
                    f"wake_up with {len(self.dropped)} weights dropped by sleep and not sent since "
                    f"({sorted(self.dropped)[0]}, ...): an update_weights comes between sleep and wake_up"
                )
            self.state = "awake"

    def metrics(self):
        with self._call("metrics", "awake", "asleep"):
            return self.hf.metrics()

    def close(self):
        with self._call("close", "awake", "asleep"):
            self.hf.close()
            self.state = "closed"

    def memory_options(self, half_prompts):
        return self.hf.memory_options(half_prompts)

    def runs_apart(self):
        return self.options.runs_apart


class StrictPlugin:
    """Registers the rollout engine ``strict``: ``register_plugin(StrictPlugin(), name="strict")``."""

    @hookimpl
    def register_rollout_engines(self, register):
        register("strict", StrictEngine)
