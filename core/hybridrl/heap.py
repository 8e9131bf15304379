"""The trainer process's garbage collector: how long its collections pause a step, and the run's
long-lived objects kept out of them.

A full collection scans every object the process tracks. With torch, transformers, a rollout
engine and torch.compile's graphs loaded that is hundreds of thousands to millions of objects and
tenths of a second, at moments no step chooses: a step that stalls for no reason of its own (an
H200 host: 0.43-0.52 s, steps of 1.6x their neighbours). When the run starts (the models and the
engine loaded) and again after its first step (which compiled and captured what the run keeps),
:meth:`Collector.freeze` moves every object alive into the collector's permanent generation
(``gc.freeze``), so later collections scan only what the steps create. SGLang advises the same for its own processes
(``Engine.freeze_gc``, which the sglang engine calls after its first generation).
"""

from __future__ import annotations

import gc
import time


class Collector:
    """Seconds of garbage collection in this process between :meth:`reset` and :meth:`metrics`
    (``timing/gc``, and ``timing/gc_longest`` for the longest single collection), heard through
    ``gc.callbacks``; :meth:`freeze` and :meth:`close` for the run's long-lived objects."""

    def __init__(self):
        self.seconds = self.longest = 0.0
        self.started: float | None = None
        self.frozen = False
        gc.callbacks.append(self._heard)

    def _heard(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
        elif self.started is not None:
            took = time.perf_counter() - self.started
            self.seconds += took
            self.longest = max(self.longest, took)
            self.started = None

    def reset(self) -> None:
        self.seconds = self.longest = 0.0

    def metrics(self) -> dict[str, float]:
        return {"timing/gc": self.seconds, "timing/gc_longest": self.longest}

    def freeze(self) -> None:
        """Collect what is garbage now, then keep everything alive out of later collections (what an
        earlier call froze stays frozen)."""
        gc.collect()
        gc.freeze()
        self.frozen = True
        self.reset()

    def close(self) -> None:
        """Stop listening; the frozen objects go back to the collector, which frees those the run
        no longer holds (a process that trains again, as tests do, would keep them otherwise)."""
        if self._heard in gc.callbacks:
            gc.callbacks.remove(self._heard)
        if self.frozen:
            gc.unfreeze()
            self.frozen = False
