"""What a step measures beside its stages, in one object the loop opens with the run: the seconds
the process's garbage collections paused it (:mod:`hybridrl.heap`, whose freezes keep the run's
long-lived objects out of them), torch.compile's seconds within it and the reasons of a compile
after the first step (:mod:`hybridrl.compile`), said on the console where they stall a step.
"""

from __future__ import annotations

from hybridrl.compile import compile_seconds, recompile_reasons, recompiled, remember_compiled
from hybridrl.heap import Collector


class StepProbes:
    """:meth:`start` before a step's stages and :meth:`finish` after them give the step's
    ``timing/gc``, ``timing/gc_longest`` (from :meth:`open` to :meth:`close`, the run's) and
    ``timing/compile``; ``is_main``: this process speaks (rank 0)."""

    def __init__(self, is_main: bool = True):
        self.is_main = is_main
        self.collector: Collector | None = None
        self.compiled = 0.0

    def open(self) -> None:
        """The run starts: its models, engine and imports stay alive to its end (frozen)."""
        self.collector = Collector()
        self.collector.freeze()

    def after_first_step(self) -> None:
        """What the first step compiled and captured stays alive to the end too (frozen), and the compile
        cache it wrote is marked warm for the next run of this shape."""
        remember_compiled()
        if self.collector is not None:
            self.collector.freeze()

    def start(self) -> None:
        self.compiled = compile_seconds()
        recompile_reasons()  # the ones before this step are no step's
        if self.collector is not None:
            self.collector.reset()

    def finish(self, step: int, first: bool) -> dict[str, float]:
        """The step's figures; after the first step, a compile prints torch's reasons (a stall: a shape
        or a branch its graphs had not seen)."""
        metrics = self.collector.metrics() if self.collector is not None else {}
        metrics["timing/compile"] = compile_seconds() - self.compiled
        again = recompile_reasons()
        if again and not first and self.is_main:
            print(recompiled(step, metrics["timing/compile"], again), flush=True)
        return metrics

    def close(self) -> None:
        """The run ends: the collector frees what the run dropped."""
        if self.collector is not None:
            self.collector.close()
            self.collector = None
