"""A user's Python function called in worker processes: every call with a time limit, a worker that
crashes or hangs replaced, the call it was running named.

One module for both sides, importing the standard library only: :class:`FunctionPool` in the
trainer, and the worker, a fresh interpreter (``python -m hybridrl_reward_python.function_pool``;
spawn semantics, nothing inherited from the trainer's memory; the package's ``__init__`` imports
only hybridrl's hook markers) that starts in a fraction of a second plus the import of the user's
file. The file is imported in the workers, never in the trainer, so its top-level code (a model
loaded at import, a client opened) runs there.

The pipe between them is a socket of its own (``multiprocessing.connection``: pickled messages),
not stdout, which the user's prints keep::

    worker -> trainer, once:  ("ready", signature)  or  ("error", message)
    trainer -> worker:        kwargs                      one call at a time
    worker -> trainer:        (True, result)  or  (False, error)

``signature``: the function's parameters as ``(name, kind, has_default)`` with ``kind`` one of
inspect's ``POSITIONAL_ONLY``... names, so the trainer can check them without importing the file.
A coroutine function (``async def``), or a function that returns an awaitable, is run to completion
on the worker's event loop.

Each worker runs under :mod:`hybridrl_reward_python.process_tree`'s supervisor: whatever processes a
call starts (a subprocess that runs the model's program, a daemon) end with the worker, when its call
times out, when it crashes, and at :meth:`FunctionPool.close`.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing import Pipe, connection
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

from hybridrl_reward_python import process_tree


class FunctionLoadError(Exception):
    """The file or the function could not be loaded in a worker; the message says which and why."""


@dataclass
class Outcome:
    """What one call gave: ``value``, or ``error`` (an exception's last line, a time-out, a crash)."""

    value: Any = None
    error: str | None = None


@dataclass
class _Worker:
    proc: subprocess.Popen
    conn: connection.Connection
    since: float  # when it started, or when it took its call
    ready: bool = False
    call: int | None = None  # the index of the call it is running


class FunctionPool:
    """``workers`` processes that each import ``path`` and call its ``function``.

    Built: every worker has imported the file (:class:`FunctionLoadError` otherwise, after at most
    ``start_timeout_s``), and :attr:`signature` describes the function. :meth:`map` runs calls,
    each within its ``timeout_s``; a worker that times out is killed, one that dies is noticed, and
    either is replaced by a fresh one, so that the next call finds the pool whole.
    """

    def __init__(self, path: str | Path, function: str, workers: int = 4, start_timeout_s: float = 60.0):
        self.path, self.function = str(path), function
        self.size, self.start_timeout_s = workers, start_timeout_s
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _stop, self._workers)
        for _ in range(workers):
            self._workers.append(self._spawn())
        self.signature, self.is_async = None, False
        for w in self._workers:
            self.signature, self.is_async = self._wait_ready(w)

    def _spawn(self) -> _Worker:
        mine, theirs = Pipe(duplex=True)
        fd = theirs.fileno()
        cmd = [sys.executable, "-m", "hybridrl_reward_python.function_pool", str(fd), self.path, self.function]
        # a session of its own (a Ctrl-C at the terminal is the trainer's to handle, not the workers'), under a
        # supervisor that ends every process the worker starts along with it
        proc = process_tree.start(cmd, pass_fds=(fd,))
        theirs.close()  # the worker holds the only other end: its death reads as end-of-file here
        return _Worker(proc, mine, time.monotonic())

    def _wait_ready(self, w: _Worker) -> tuple[list, bool]:
        left = self.start_timeout_s - (time.monotonic() - w.since)
        if not w.conn.poll(max(left, 0)):
            self.close()
            raise FunctionLoadError(
                f"importing {self.path} in a worker process took more than {self.start_timeout_s:g} s."
            )
        try:
            kind, info = w.conn.recv()
        except (EOFError, OSError):
            kind, info = "error", f"the worker process exited ({_exit_status(w.proc)}) while importing it."
        if kind == "error":
            self.close()
            raise FunctionLoadError(info)
        w.ready = True
        return info

    def map(self, calls: list[dict], timeout_s: float) -> list[Outcome]:
        """Call the function with each of ``calls`` (keyword arguments), spread over the workers;
        one :class:`Outcome` per call, in order. A call running longer than ``timeout_s`` seconds
        has its worker killed and reads ``timed out after ... s``; a worker that dies reads
        ``the worker process exited (...)``; both workers are replaced at once."""
        out: list[Outcome | None] = [None] * len(calls)
        todo = deque(range(len(calls)))
        while todo or any(w.call is not None for w in self._workers):
            for w in self._workers:
                if w.ready and w.call is None and todo:
                    w.call, w.since = todo.popleft(), time.monotonic()
                    try:
                        w.conn.send(calls[w.call])
                    except OSError:  # the worker is gone: reading its pipe below says so
                        pass
                    except Exception as e:  # noqa: BLE001 - arguments pickle refuses: this call's fault alone
                        out[w.call], w.call = Outcome(error=f"its arguments cannot be sent: {e}"), None
            waiting = [w for w in self._workers if w.call is not None or not w.ready]
            limits = [(timeout_s if w.ready else self.start_timeout_s) - (time.monotonic() - w.since) for w in waiting]
            for conn in connection.wait([w.conn for w in waiting], timeout=max(min(limits, default=0), 0)):
                self._receive(next(w for w in waiting if w.conn is conn), out)
            now = time.monotonic()
            for w in list(self._workers):
                if w.call is not None and now - w.since > timeout_s:
                    out[w.call] = Outcome(error=f"timed out after {timeout_s:g} s")
                    self._replace(w)
                elif not w.ready and now - w.since > self.start_timeout_s:
                    self.close()
                    raise FunctionLoadError(
                        f"a new worker took more than {self.start_timeout_s:g} s to import {self.path}."
                    )
        return out

    def _receive(self, w: _Worker, out: list) -> None:
        try:
            message = w.conn.recv()
        except (EOFError, OSError):
            message = None
        if message is None and w.call is None:  # died while importing the file, which worked before
            status = _exit_status(w.proc)
            self.close()
            raise FunctionLoadError(f"a new worker process exited ({status}) while importing {self.path}.")
        if message is None:
            out[w.call] = Outcome(error=f"the worker process exited ({_exit_status(w.proc)})")
            self._replace(w)
            return
        if not w.ready:
            if message[0] == "error":
                self.close()
                raise FunctionLoadError(message[1])
            w.ready = True
            return
        ok, value = message
        out[w.call], w.call = (Outcome(value=value) if ok else Outcome(error=value)), None

    def _replace(self, w: _Worker) -> None:
        _kill(w)
        self._workers[self._workers.index(w)] = self._spawn()

    def close(self) -> None:
        """Stop every worker: each exits when its pipe closes; one that does not within a second is killed.
        Either way every process a worker started ends with it (:mod:`.process_tree`): none is left."""
        self._finalizer()


def _stop(workers: list[_Worker]) -> None:
    for w in workers:
        w.conn.close()
    deadline = time.monotonic() + 1.0
    for w in workers:
        try:
            w.proc.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            pass
        _kill(w)  # ends what it started; waits for its supervisor, which has exited already if it did
    workers.clear()


def _kill(w: _Worker) -> None:
    """Ends the worker and every process it started, and waits until they are gone."""
    w.conn.close()
    process_tree.stop(w.proc)


def _exit_status(proc: subprocess.Popen) -> str:
    try:
        code = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return "still running"
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


# -- the worker's side ----------------------------------------------------------------------


def load_function(path: str, name: str):
    """``name`` from the Python file ``path``, imported as a module (its folder on ``sys.path``
    first, so that it can import its neighbours)."""
    file = Path(path)
    if not file.is_file():
        raise FunctionLoadError(f"{path}: no such file.")
    sys.path.insert(0, str(file.parent))
    spec = importlib.util.spec_from_file_location(f"hybridrl_user_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 - the user's top-level code: report whatever it raised
        raise FunctionLoadError(f"importing {path} failed: {_error_line(e, path)}") from e
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise FunctionLoadError(f"{path} defines no function '{name}'. Functions it has: {', '.join(defined)}.")
    if not callable(fn):
        raise FunctionLoadError(f"{path}: '{name}' is a {type(fn).__name__}, not a function.")
    return fn


def describe(fn) -> tuple[list[tuple[str, str, bool]] | None, bool]:
    """The parameters of ``fn`` as ``(name, kind, has_default)`` (None where Python cannot tell, as
    for some built-ins), and whether it is ``async def``."""
    import inspect

    try:
        params = [(p.name, p.kind.name, p.default is not p.empty) for p in inspect.signature(fn).parameters.values()]
    except (ValueError, TypeError):
        params = None
    return params, inspect.iscoroutinefunction(fn)


def _error_line(e: BaseException, path: str) -> str:
    """``Type: message (file.py:line)``: the exception and the deepest line of the user's file it passed."""
    import traceback

    where = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename) == Path(path)]
    line = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()[-1]
    return f"{line} ({Path(path).name}:{where[-1].lineno})" if where else line


def _watch_parent() -> None:
    """Exit when the supervisor is gone (it ends the worker itself when the trainer is), even while a call hangs."""
    import threading

    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _serve(fd: int, path: str, name: str) -> None:
    import asyncio

    conn = connection.Connection(fd)
    _watch_parent()
    try:
        fn = load_function(path, name)
        message = _pickled(("ready", describe(fn)))
    except FunctionLoadError as e:
        fn, message = None, _pickled(("error", str(e)))
    loop = asyncio.new_event_loop()
    while True:
        try:
            conn.send_bytes(message)
            if fn is None:
                return
            kwargs = conn.recv()
        except (EOFError, OSError):  # the trainer closed the pool
            return
        message = _call(fn, kwargs, loop, path)


def _call(fn, kwargs: dict, loop, path: str) -> bytes:
    """The answer to one call, pickled: ``(True, result)`` or ``(False, error)``."""
    import inspect

    try:
        result = fn(**kwargs)
        if inspect.isawaitable(result):
            result = loop.run_until_complete(result)
    except Exception as e:  # noqa: BLE001 - the user's function: report whatever it raised
        return _pickled((False, _error_line(e, path)))
    try:
        return _pickled((True, result))
    except Exception as e:  # noqa: BLE001 - an object pickle refuses
        return _pickled((False, f"it returned a {type(result).__name__}, which cannot be sent back: {e}"))


def _pickled(message) -> bytes:
    return bytes(ForkingPickler.dumps(message))


if __name__ == "__main__":
    _serve(int(sys.argv[1]), sys.argv[2], sys.argv[3])
