"""Ctrl-C and SIGTERM: finish the step, save a checkpoint, stop; every rank after the same step."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

from hybridrl import distributed


class StopSignals:
    """Remembers the first SIGINT/SIGTERM while it is active; a second Ctrl-C stops at once."""

    def __init__(self):
        self.name: str | None = None

    @contextlib.contextmanager
    def catch(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            name = signal.Signals(signum).name
            if self.name and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.name = name
            if distributed.is_main():
                print(
                    f"\n{name}: finishing this step, then saving a checkpoint (Ctrl-C again to stop at once "
                    "without saving).",
                    file=sys.stderr,
                    flush=True,
                )

        previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def agree(self) -> str | None:
        """The signal any rank saw, on every rank (checkpoints are collective); None if none did."""
        if distributed.world_size() > 1:
            seen = [s for s in distributed.all_gather_objects(self.name) if s]
            self.name = self.name or (seen[0] if seen else None)
        return self.name

    @property
    def exit_code(self) -> int:
        return 143 if self.name == "SIGTERM" else 130
