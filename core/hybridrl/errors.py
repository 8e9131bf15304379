"""The errors hybridrl raises on purpose: each message names the component, the call and the fix."""

from __future__ import annotations

import contextlib


class ConfigError(ValueError):
    """The config is invalid; the message names the key and the valid choices."""


class StageError(RuntimeError):
    """A component failed; the message says which one, in which call, and why."""


class NonFiniteError(FloatingPointError):
    """A NaN or Inf reached rewards, advantages, the loss or the gradient."""


class Interrupted(Exception):
    """The run stopped on Ctrl-C or SIGTERM after saving a checkpoint."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


@contextlib.contextmanager
def stage_errors(component: str, call: str):
    """Re-raise any failure inside as a StageError naming the component and the call."""
    try:
        yield
    except (StageError, KeyboardInterrupt, NonFiniteError, ConfigError):
        raise
    except Exception as e:
        raise StageError(f"{component} failed in {call}: {type(e).__name__}: {e}") from e
