"""The errors hybridrl raises on purpose: each message names the component, the call and the fix."""

from __future__ import annotations

import contextlib
import difflib
import sys
from pathlib import Path


class ConfigError(ValueError):
    """The config is invalid; the message names the key and the valid choices."""


def did_you_mean(word: str, choices) -> str:
    """``" Did you mean 'x'?"`` for the closest of ``choices`` to ``word``, or ``""`` when none is close.

    Put it right after the sentence that names the unknown word, before the list of valid choices:
    ``f"Unknown key {key!r} in {section}.{did_you_mean(key, valid)} Valid keys: ..."``."""
    match = close_match(word, choices)
    return f" Did you mean {match!r}?" if match is not None else ""


def close_match(word: str, choices) -> str | None:
    """The closest of ``choices`` to ``word`` (difflib's ratio of at least 0.6), or None."""
    matches = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return matches[0] if matches else None


def package_not_installed(name: str) -> str:
    """Why ``package:NAME`` finds no package, and the fix: an installed package of a close name before
    ``pip install`` (a misspelt name on PyPI may be anyone's package)."""
    import pkgutil

    near = close_match(name, [m.name for m in pkgutil.iter_modules() if m.ispkg])
    if near is not None:
        return f"package '{name}' is not installed. Did you mean 'package:{near}'? It is installed."
    dist = name.replace("_", "-")
    return (
        f"package '{name}' is not installed. If '{dist}' on PyPI is the package you mean (check its name "
        f"and author first: a misspelt name may be someone else's), install it with: pip install --no-deps {dist}"
    )


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
        raise StageError(f"{component} failed in {call}: {type(e).__name__}: {str(e) or origin(e)}") from e


def origin(e: BaseException) -> str:
    """Where ``e`` was raised, for an exception without a message (a bare ``assert`` in a library)."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return "(no message)"
    last = frames[-1]
    where = Path(last.filename)
    where = Path(*where.parts[where.parts.index("site-packages") + 1 :]) if "site-packages" in where.parts else where
    return f"(no message) raised at {where}:{last.lineno} in {last.name}: {last.line}"


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
