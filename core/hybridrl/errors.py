"""The errors hybridrl raises on purpose: each message names the component, the call and the fix."""

from __future__ import annotations

import contextlib
import sys


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


def nonfinite(step: int, what: str, on_nonfinite: str, last_checkpoint=None) -> None:
    """A NaN/Inf in ``what``: raise :class:`NonFiniteError` (``trainer.on_nonfinite: abort``), or warn
    and return so that the caller skips the update (``skip``)."""
    if on_nonfinite == "abort":
        kept = (
            f"the last checkpoint ({last_checkpoint}) is intact" if last_checkpoint else "no checkpoint was written yet"
        )
        raise NonFiniteError(
            f"step {step}: {what}. The run stops; {kept}. Set trainer.on_nonfinite=skip to skip such updates instead."
        )
    from hybridrl import distributed

    if distributed.is_main():
        print(f"warning: step {step}: {what}; skipping the update.", file=sys.stderr, flush=True)
