"""Loggers ``wandb`` (Weights & Biases, offline without an account) and ``tensorboard``.

A first-party plugin (the ``hybridrl-trackers`` distribution, entry point ``trackers``): the core
keeps the loggers that write the run's own record (``console``, ``jsonl``), and the integrations
with outside trackers live here, registered through ``register_loggers`` like any third party's.
Both import their library when the logger is built, so neither is a dependency; a missing library
is an error that names the package to install.
"""

from __future__ import annotations

import math
import netrc
import os
from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

from pydantic import Field

from hybridrl.builtin.loggers import clean_metrics, clean_value
from hybridrl.components import Logger, Options
from hybridrl.config_files import load_yaml
from hybridrl.hookspecs import hookimpl

__version__ = "0.1.0"


def sample_columns(rows: list[dict]) -> list[str]:
    """Column names of sample rows: ``step`` first, then keys in first-seen order."""
    cols = ["step"]
    for row in rows:
        cols += [k for k in row if k not in cols]
    return cols


def _cell(value):
    value = clean_value(value)
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)


# --- Weights & Biases ----------------------------------------------------------------------


def wandb_api_key_configured() -> bool:
    """Whether wandb would find an API key: ``WANDB_API_KEY`` or a netrc entry for its host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


class WandbLogger(Logger):
    """Metrics with ``wandb.log(..., step=step)``; rollout samples as a ``wandb.Table`` named
    ``samples``; the run config (config.yaml of the run dir) as the wandb config."""

    class Options(Options):
        project: str = Field("hybridrl", description="W&B project.")
        entity: str | None = Field(None, description="W&B entity (user or team); default: your default entity.")
        name: str | None = Field(None, description="Run name; default: the run directory's name.")
        mode: Literal["online", "offline", "disabled"] | None = Field(
            None,
            description="W&B mode; default: WANDB_MODE if set, else 'online' when an API key is configured "
            "(WANDB_API_KEY or wandb login), else 'offline' (sync later with 'wandb sync').",
        )
        tags: list[str] = Field(default_factory=list, description="Run tags.")
        group: str | None = Field(None, description="Run group (to compare runs side by side).")
        dir: str | None = Field(None, description="Where wandb writes its files; default: the run directory.")

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                f"logger 'wandb' (logging.loggers) needs the wandb package ({e}). "
                "Install it with: pip install wandb (or the plugin's extra: pip install -e 'plugins/trackers[wandb]')"
            ) from None
        self.wandb = wandb
        self.run = None

    def resolved_mode(self) -> str:
        if self.options.mode:
            return self.options.mode
        env = os.environ.get("WANDB_MODE")
        if env in ("online", "offline", "disabled"):
            return env
        if env in ("dryrun",):
            return "offline"
        return "online" if wandb_api_key_configured() else "offline"

    def open(self, total_steps, start_step):
        run_dir = Path(self.ctx.run_dir)
        o = self.options
        config_file = run_dir / "config.yaml"
        config = load_yaml(config_file.read_text(), str(config_file)) if config_file.is_file() else None
        id_file = run_dir / "wandb-run-id"
        resume = {}
        if start_step > 0 and id_file.is_file():  # a resumed run continues the same wandb run
            resume = {"id": id_file.read_text().strip(), "resume": "allow"}
        self.run = self.wandb.init(
            project=o.project,
            entity=o.entity,
            name=o.name or run_dir.name,
            mode=self.resolved_mode(),
            tags=o.tags or None,
            group=o.group,
            dir=str(Path(o.dir) if o.dir else run_dir),
            config=config,
            **resume,
        )
        if self.run is not None and getattr(self.run, "id", None):
            id_file.write_text(str(self.run.id))

    def log(self, step, metrics):
        values = {k: v for k, v in clean_metrics(metrics, "wandb").items() if v is not None}
        self.run.log(values, step=step)

    def log_samples(self, step, rows):
        if not rows:
            return
        columns = sample_columns(rows)
        data = [[step if c == "step" else _cell(row.get(c)) for c in columns] for row in rows]
        self.run.log({"samples": self.wandb.Table(columns=columns, data=data)}, step=step)

    def close(self):
        if self.run is not None:
            self.run.finish()
            self.run = None


# --- TensorBoard ---------------------------------------------------------------------------


def _summary_writer():
    try:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        return SummaryWriter
    except ImportError:
        pass
    try:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    except ImportError:
        raise ImportError(
            "logger 'tensorboard' (logging.loggers) needs the tensorboard package (or tensorboardX). "
            "Install it with: pip install tensorboard "
            "(or the plugin's extra: pip install -e 'plugins/trackers[tensorboard]')"
        ) from None


def samples_markdown(rows: list[dict], max_chars: int) -> str:
    """Samples as a markdown table (TensorBoard's text tab renders it)."""
    columns = [c for c in sample_columns(rows) if c != "step"]

    def cell(value) -> str:
        value = _cell(value)
        if isinstance(value, float):
            text = f"{value:.4g}" if math.isfinite(value) else str(value)
        else:
            text = "" if value is None else str(value)
            if len(text) > max_chars:  # the end of a long prompt or response is what differs
                text = "…" + text[-max_chars:]
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


class TensorBoardLogger(Logger):
    """Scalars with ``add_scalar(name, value, step)``; samples as a markdown table in the text tab."""

    class Options(Options):
        log_dir: str | None = Field(None, description="Event file directory; default: <run dir>/tensorboard.")
        flush_secs: int = Field(10, gt=0, description="Seconds between flushes of pending events to disk.")
        samples: bool = Field(True, description="Write rollout samples as a text table ('samples').")
        max_chars: int = Field(500, gt=0, description="Longest prompt/response text shown per sample cell.")

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.writer_cls = _summary_writer()
        self.writer = None

    def open(self, total_steps, start_step):
        log_dir = Path(self.options.log_dir) if self.options.log_dir else Path(self.ctx.run_dir) / "tensorboard"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = self.writer_cls(log_dir=str(log_dir), flush_secs=self.options.flush_secs)

    def log(self, step, metrics):
        for key, value in clean_metrics(metrics, "tensorboard").items():
            if value is not None:
                self.writer.add_scalar(key, value, global_step=step)

    def log_samples(self, step, rows):
        if self.options.samples and rows:
            self.writer.add_text("samples", samples_markdown(rows, self.options.max_chars), global_step=step)

    def close(self):
        if self.writer is not None:
            self.writer.close()
            self.writer = None


@hookimpl
def register_loggers(register):
    register("wandb", WandbLogger)
    register("tensorboard", TensorBoardLogger)
