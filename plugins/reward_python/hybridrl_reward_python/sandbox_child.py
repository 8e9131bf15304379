"""The sandbox's child process: compiles the CPython WASI module, or runs one call in it under its
limits and reports how it ended (see :mod:`hybridrl_reward_python.sandbox` for the boundary).

It runs in the child that :mod:`hybridrl_reward_python.sandbox` starts, never in the trainer, and is
loaded there by its path (``python -I``, :func:`main` the entry point), not through its package:
so it imports the standard library only (wasmtime comes as an argument), nothing of hybridrl.
"""

from __future__ import annotations

import json
import math
import os
import signal
import stat
import threading
import time

_GUEST_WORK = "/scratch"
_GUEST_ENV = [
    ("PYTHONHOME", "/usr/local"),
    ("PYTHONHASHSEED", "0"),
    ("PYTHONDONTWRITEBYTECODE", "1"),
    ("HOME", _GUEST_WORK),
    ("TMPDIR", _GUEST_WORK),
]
# Runs in the guest before the call's code, which comes as the next argument.
_GUEST_MAIN = (
    f"import os; os.chdir({_GUEST_WORK!r}); del os; exec(compile(__import__('sys').argv.pop(1), '<tool call>', 'exec'))"
)
# part of the compile cache's key: change it with _engine (a compiled module holds the settings it was compiled with)
ENGINE_KEY = "epoch-interruption-v1"
_STOP_GRACE_S = 0.5  # after an interrupt, how long the watchdog waits before it ends the child
_DATA_OVERHEAD_MB = 128  # the child's own memory (interpreter, wasmtime, module) over the guest's
_ENTRY_BYTES = 4096  # what a file or folder costs at least, towards the scratch folder's total


def main(argv: list[str]) -> None:
    """``compile WASM TARGET``: the module's machine code to TARGET; ``run JOB``: the call JOB.json describes."""
    import wasmtime

    engine = _engine(wasmtime)
    if argv[0] == "compile":
        wasm, target = argv[1:3]
        data = wasmtime.Module.from_file(engine, wasm).serialize()
        partial = f"{target}.{os.getpid()}.partial"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        with open(os.open(partial, flags, 0o600), "wb") as f:  # this user's alone, as untrusted() asks
            f.write(data)
        os.replace(partial, target)
        return
    with open(argv[1]) as f:
        job = json.load(f)
    _run_guest(wasmtime, engine, job)


def untrusted(path: str, st: os.stat_result) -> str | None:
    """Why the compile cache's folder or file ``path`` (``st``: its status, not following a link) cannot
    be trusted: it is not this user's, others can write it, or it is neither a folder nor a regular
    file (a link, say); None when it can. A compiled module is machine code the sandbox's process runs:
    loaded from a place someone else can write, it would run their code."""
    if st.st_uid != os.getuid():
        return f"{path} belongs to user id {st.st_uid}, not to this user ({os.getuid()})"
    if st.st_mode & 0o022:
        return f"{path} can be written by other users (mode {stat.S_IMODE(st.st_mode):o})"
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        return f"{path} is neither a folder nor a regular file"
    return None


def open_trusted(path: str) -> int:
    """The compiled module ``path``, opened for reading: the descriptor of the very file checked, its
    folder and itself trusted (:func:`untrusted`), a link not followed. OSError saying why otherwise."""
    folder, name = os.path.split(path)
    dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    try:
        why = untrusted(folder, os.fstat(dir_fd))
        if why is None:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
            why = untrusted(path, os.fstat(fd))
            if why is None:
                return fd
            os.close(fd)
    finally:
        os.close(dir_fd)
    raise PermissionError(why)


def _load_module(wasmtime, engine, path: str):
    """The compiled module at ``path``, loaded from the descriptor :func:`open_trusted` checked (its
    /proc path, where there is one, so that a file swapped in after the check is not the one loaded)."""
    fd = open_trusted(path)
    try:
        by_fd = f"/proc/self/fd/{fd}"
        return wasmtime.Module.deserialize_file(engine, by_fd if os.path.exists(by_fd) else path)
    finally:
        os.close(fd)


def _engine(wasmtime):
    config = wasmtime.Config()
    config.epoch_interruption = True  # keep ENGINE_KEY in step with these settings
    return wasmtime.Engine(config)


def _report(job: dict, status: dict) -> None:
    with open(job["status"], "w") as f:
        json.dump(status, f)


def _limit_self(limits: dict) -> None:
    """The OS's limits on this process: a second line behind the sandbox's own."""
    import resource

    cpu = math.ceil(limits["cpu_s"]) + 1
    data = (limits["memory_mb"] + _DATA_OVERHEAD_MB) << 20
    size = limits["file_mb"] << 20
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_DATA, (data, data))
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the file limit fails instead


def _run_guest(wasmtime, engine, job: dict) -> None:
    limits = job["limits"]
    _limit_self(limits)
    try:
        module = _load_module(wasmtime, engine, job["module"])
    except OSError as e:  # refused, or gone: the trainer checks it again, compiles it again if it can
        return _report(job, {"module_untrusted": str(e)})
    except wasmtime.WasmtimeError as e:
        return _report(job, {"module_unusable": str(e).splitlines()[0]})
    store = wasmtime.Store(engine)
    store.set_limits(memory_size=limits["memory_mb"] << 20)
    store.set_epoch_deadline(1)  # the first increment_epoch interrupts it
    wasi = wasmtime.WasiConfig()
    wasi.argv = ["python", "-c", _GUEST_MAIN, job["code"]]
    wasi.env = _GUEST_ENV
    wasi.preopen_dir(job["work"], _GUEST_WORK)
    wasi.preopen_dir(job["stdlib"], "/usr/local/lib", False)
    wasi.inherit_stdout()
    wasi.inherit_stderr()
    store.set_wasi(wasi)
    linker = wasmtime.Linker(engine)
    linker.define_wasi()
    watchdog = _Watchdog(engine, limits, job)
    watchdog.start()
    try:
        linker.instantiate(store, module).exports(store)["_start"](store)
        status = {"exit_code": 0}
    except wasmtime.ExitTrap as e:
        status = {"exit_code": e.code}
    except (wasmtime.Trap, wasmtime.WasmtimeError) as e:
        status = {"crash": (str(e).strip().splitlines() or [type(e).__name__])[0]}
    stopped = watchdog.finish()
    _report(job, {"stopped": stopped} if stopped else status)


class _Watchdog(threading.Thread):
    """Stops the module at the CPU, wall-clock or scratch-folder limit (epoch interruption); ends the
    process when the module cannot be interrupted (blocked in a host call)."""

    def __init__(self, engine, limits: dict, job: dict):
        super().__init__(daemon=True)
        self.engine, self.limits, self.job = engine, limits, job
        self.stopped: str | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()

    def finish(self) -> str | None:
        with self._lock:
            self._done.set()
            return self.stopped

    def run(self) -> None:
        start = time.monotonic()
        next_disk = start
        while not self._done.wait(0.01):
            now, reason = time.monotonic(), None
            if time.process_time() > self.limits["cpu_s"]:
                reason = "cpu"
            elif now - start > self.limits["timeout_s"]:
                reason = "wall"
            elif now >= next_disk:
                next_disk = now + 0.1
                if _disk_usage(self.job["work"], limit=self.limits["disk_mb"] << 20):
                    reason = "disk"
            if reason is None:
                continue
            with self._lock:
                if self._done.is_set():
                    return
                self.stopped = reason
            self.engine.increment_epoch()
            if not self._done.wait(_STOP_GRACE_S):
                with self._lock:  # unless the module stopped meanwhile and the main thread reports
                    if not self._done.is_set():
                        _report(self.job, {"stopped": reason})
                        os._exit(0)
            return


def _disk_usage(folder: str, limit: int) -> bool:
    """Whether the files and folders under ``folder`` take more than ``limit`` bytes (each at least
    ``_ENTRY_BYTES``). Stops counting at the limit; a tree it cannot walk counts as over it."""
    total, stack = 0, [folder]
    while stack:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    try:
                        total += max(entry.stat(follow_symlinks=False).st_size, _ENTRY_BYTES)
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
                    except FileNotFoundError:  # removed since it was listed
                        continue
                    if total > limit:
                        return True
        except FileNotFoundError:
            continue
        except OSError:
            return True
    return False
