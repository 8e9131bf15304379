"""Loggers ``console`` (progress bar and one line per step) and ``jsonl`` (files in the run dir).

The JSONL files are the run's record; the dashboard (``hybridrl dashboard RUN_DIR``) reads them.

``metrics.jsonl``: one object per step, ``{"step": int, "time": unix seconds, "<metric>": number
or null, ...}``; a value that is NaN or infinite is written as ``null``.

``samples.jsonl``: one object per rollout sample, written every ``trainer.sample_every`` steps:
``{"step": int, "index": position in the step's batch, "prompt": str, "response": str,
"score": number|null, "reward/<name>": number|null, "advantage": number|null, ...}`` plus
whatever else the trainer puts in a sample row (``answer``, ``finish_reason``).
Both are 0600 from the first row; :func:`clean_metrics` and :func:`clean_value` (every logger's) write a
value that a ``${env:VAR}`` of the config read as ``${env:VAR}``, in text and in metric names.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

from pydantic import Field

from hybridrl.components import Logger, Options
from hybridrl.config_files import private_open, scrub_env
from hybridrl.hookspecs import hookimpl

log = logging.getLogger(__name__)
_warned: set[str] = set()


def to_number(value) -> float | None:
    """A metric value as a finite float, or None (None, NaN, inf); raises TypeError or
    ValueError if it is not a number (a string, a tensor of several elements)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)):
        raise TypeError(f"not a number: {value!r}")
    if hasattr(value, "item"):  # torch tensors and numpy scalars of one element
        value = value.item()
    v = float(value)
    return v if math.isfinite(v) else None


def clean_metrics(metrics: dict, who: str = "logger") -> dict[str, float | None]:
    """Every value as a float or None (NaN/inf); values that are not numbers are dropped with
    one warning per key, so a bad metric never stops the run."""
    out: dict[str, float | None] = {}
    for key, value in metrics.items():
        try:
            out[scrub_env(str(key))] = to_number(value)
        except (TypeError, ValueError, RuntimeError):
            if (who, key) not in _warned:
                _warned.add((who, key))
                log.warning("%s: metric %r has the non-numeric value %r; it is not logged.", who, key, value)
    return out


def clean_value(value):
    """A sample field as JSON: numbers (NaN/inf -> None), strings (``${env:VAR}`` values scrubbed),
    lists and dicts of those."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return scrub_env(value)
    if isinstance(value, dict):
        return {scrub_env(str(k)): clean_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_value(v) for v in value]
    try:
        return to_number(value)
    except (TypeError, ValueError, RuntimeError):
        pass
    if hasattr(value, "tolist"):  # tensors and arrays of several elements
        return clean_value(value.tolist())
    return str(value)


def _fmt(m: dict, key: str, spec: str) -> str:
    v = m.get(key)
    try:
        return format(float(v), spec) if v is not None else "-"
    except (TypeError, ValueError):
        return "?"


def summary_line(step: int, total: int, m: dict[str, float]) -> str:
    """``step 3/20 | reward 0.22 ± 0.41 | kl 0.0012 | len 14.2 | rollout 9.8s | step 21.3s`` (and
    ``| of which compiling 30.2s`` in a step that compiled); an
    evaluation's row: ``step 20/20 | eval chain_sum mean@1 0.617 | eval 4.1s``."""
    parts = [f"step {step}/{total}" if total else f"update {step}"]
    if "reward/mean" in m:
        parts.append(f"reward {_fmt(m, 'reward/mean', '.3f')} ± {_fmt(m, 'reward/std', '.3f')}")
    if "actor/kl" in m:
        parts.append(f"kl {_fmt(m, 'actor/kl', '.4f')}")
    if "response_length/mean" in m:
        parts.append(f"len {_fmt(m, 'response_length/mean', '.1f')}")
    if "actor/pg_loss" in m:
        parts.append(f"loss {_fmt(m, 'actor/pg_loss', '+.4f')}")
    for stage in ("rollout", "update", "step"):
        if f"timing/{stage}" in m:
            parts.append(f"{stage} {_fmt(m, f'timing/{stage}', '.1f')}s")
    if isinstance(m.get("timing/compile"), (int, float)) and m["timing/compile"] >= 0.05:
        parts.append(f"of which compiling {_fmt(m, 'timing/compile', '.1f')}s")  # why a step is slow
    for key in m:  # an evaluation's row: each set's mean@n and pass@k (docs/evaluation.md)
        name, _, metric = key.removeprefix("eval/").rpartition("/")
        if key.startswith("eval/") and "/" not in name and metric.startswith(("mean@", "pass@")):
            parts.append(f"eval {name} {metric} {_fmt(m, key, '.3f')}")
    if "timing/eval" in m:
        parts.append(f"eval {_fmt(m, 'timing/eval', '.1f')}s")
    return " | ".join(parts)


class ConsoleLogger(Logger):
    class Options(Options):
        progress: bool = Field(True, description="Show a progress bar (on a terminal).")
        every: int = Field(1, gt=0, description="Print the summary line every N steps (and at the last step).")

    def open(self, total_steps, start_step):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.total = total_steps
        self.console = Console(stderr=False)
        self.progress = None
        if self.options.progress and self.console.is_terminal and total_steps:
            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[reward]}"),
                console=self.console,
                transient=True,
            )
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step, reward="")
            self.progress.start()

    def log(self, step, metrics):
        shown = step % self.options.every == 0 or step == self.total
        line = summary_line(step, self.total, metrics) if shown else None
        if self.progress is not None:
            if line:
                self.progress.console.print(line, highlight=False, markup=False)
            reward = f"reward {_fmt(metrics, 'reward/mean', '.3f')}" if "reward/mean" in metrics else ""
            self.progress.update(self.task, completed=step, reward=reward)
        elif line:
            print(line, flush=True)

    def close(self):
        if getattr(self, "progress", None) is not None:
            self.progress.stop()


class JSONLLogger(Logger):
    """``metrics.jsonl``: one object per step; ``samples.jsonl``: rollout samples with their step.

    A run that starts at step 1 starts both files afresh; a resumed run (``start_step`` > 0)
    appends to them (the trainer has dropped rows after its checkpoint), so each step has one
    metrics row.
    """

    def open(self, total_steps, start_step):
        run_dir = Path(self.ctx.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        mode = "a" if start_step > 0 else "w"
        self.metrics = private_open(run_dir / "metrics.jsonl", mode)
        self.samples = private_open(run_dir / "samples.jsonl", mode)

    def log(self, step, metrics):
        row = {"step": int(step), "time": round(time.time(), 3), **clean_metrics(metrics, "jsonl")}
        self.metrics.write(json.dumps(row, allow_nan=False) + "\n")
        self.metrics.flush()

    def log_samples(self, step, rows):
        for index, row in enumerate(rows):
            out = {"step": int(step), "index": index, **clean_value(dict(row))}
            self.samples.write(json.dumps(out, allow_nan=False, ensure_ascii=False) + "\n")
        self.samples.flush()

    def close(self):
        for f in (getattr(self, "metrics", None), getattr(self, "samples", None)):
            if f is not None:
                f.close()


@hookimpl
def register_loggers(register):
    register("console", ConsoleLogger)
    register("jsonl", JSONLLogger)
