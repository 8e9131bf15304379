"""Loggers ``console`` (progress bar and one line per step) and ``jsonl`` (files in the run dir)."""

from __future__ import annotations

import json
import math

from pydantic import Field

from hybridrl.components import Logger, Options
from hybridrl.hookspecs import hookimpl


def summary_line(step: int, total: int, m: dict[str, float]) -> str:
    """``step 3/20 | reward 0.22 ± 0.41 | kl 0.0012 | len 14.2 | rollout 9.8s | step 21.3s``."""
    parts = [f"step {step}/{total}"]
    if "reward/mean" in m:
        parts.append(f"reward {m['reward/mean']:.3f} ± {m.get('reward/std', 0.0):.3f}")
    if "actor/kl" in m:
        parts.append(f"kl {m['actor/kl']:.4f}")
    if "response_length/mean" in m:
        parts.append(f"len {m['response_length/mean']:.1f}")
    if "actor/pg_loss" in m:
        parts.append(f"loss {m['actor/pg_loss']:+.4f}")
    for stage in ("rollout", "update", "step"):
        if f"timing/{stage}" in m:
            parts.append(f"{stage} {m[f'timing/{stage}']:.1f}s")
    return " | ".join(parts)


class ConsoleLogger(Logger):
    class Options(Options):
        progress: bool = Field(True, description="Show a progress bar (on a terminal).")

    def open(self, total_steps, start_step):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.total = total_steps
        self.console = Console(stderr=False)
        self.progress = None
        if self.options.progress and self.console.is_terminal:
            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                console=self.console,
                transient=True,
            )
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step)
            self.progress.start()

    def log(self, step, metrics):
        line = summary_line(step, self.total, metrics)
        if self.progress is not None:
            self.progress.console.print(line, highlight=False)
            self.progress.update(self.task, completed=step)
        else:
            print(line, flush=True)

    def close(self):
        if getattr(self, "progress", None) is not None:
            self.progress.stop()


class JSONLLogger(Logger):
    """``metrics.jsonl``: one object per step; ``samples.jsonl``: rollout samples with their step."""

    def open(self, total_steps, start_step):
        self.ctx.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = open(self.ctx.run_dir / "metrics.jsonl", "a")
        self.samples = open(self.ctx.run_dir / "samples.jsonl", "a")

    def log(self, step, metrics):
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self.metrics.write(json.dumps(row) + "\n")
        self.metrics.flush()

    def log_samples(self, step, rows):
        for row in rows:
            self.samples.write(json.dumps({"step": step, **row}) + "\n")
        self.samples.flush()

    def close(self):
        for f in (getattr(self, "metrics", None), getattr(self, "samples", None)):
            if f is not None:
                f.close()


def _clean(v):
    v = float(v)
    return None if math.isnan(v) or math.isinf(v) else v


@hookimpl
def register_loggers(register):
    register("console", ConsoleLogger)
    register("jsonl", JSONLLogger)
