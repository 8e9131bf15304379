"""Built-in tools: ``calculator`` (arithmetic, no code run) and ``python`` (code in a sandboxed process).

The ``python`` tool runs each call in a fresh interpreter (``python -I``) that first lowers its own
limits on CPU time, memory and file size (no ``preexec_fn``: calls run from threads), under a
wall-clock timeout, in a temporary folder of its own that is removed afterwards.
An audit hook installed before the code runs refuses network access, new processes, native code
loading and any write outside that folder; where the kernel allows it (``unshare -rn``: a user and
network namespace, no root needed on most Linux systems) the process also has no network at all.
"""

from __future__ import annotations

import ast
import functools
import math
import operator
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from pydantic import Field

from hybridrl.components import Options, Tool
from hybridrl.hookspecs import hookimpl

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class Calculator(Tool):
    """Evaluates an arithmetic expression: numbers, + - * / // % **, parentheses."""

    class Options(Options):
        max_digits: int = Field(60, gt=0, description="Refuse results with more digits than this.")

    def schema(self) -> dict:
        return {
            "type": "function",
            "function": {
                "name": "calculator",
                "description": "Evaluate an arithmetic expression, e.g. 12 * (3 + 4) ** 2.",
                "parameters": {
                    "type": "object",
                    "properties": {"expression": {"type": "string", "description": "The expression."}},
                    "required": ["expression"],
                },
            },
        }

    def __call__(self, arguments: dict) -> str:
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            raise ValueError('give the expression as a string: {"expression": "2 + 2"}')
        value = self._eval(ast.parse(expression.strip(), mode="eval").body)
        if isinstance(value, float):
            return f"{value:.12g}"
        return str(value)

    def _eval(self, node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) * math.log10(max(abs(left), 2)) > self.options.max_digits:
                raise ValueError(f"the result would have more than {self.options.max_digits} digits")
            value = _BINARY[type(node.op)](left, right)
            if isinstance(value, int) and len(str(abs(value))) > self.options.max_digits:
                raise ValueError(f"the result has more than {self.options.max_digits} digits")
            return value
        raise ValueError(f"only numbers and + - * / // % ** are allowed, not {type(node).__name__}")


# Runs in the child before the model's code: limits what the code can reach (an audit hook cannot be
# removed again from Python). Writes are allowed only inside the call's own folder.
_GUARD = r"""
import os, resource, sys
_cpu, _memory, _file = (int(x) for x in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_CPU, (_cpu, _cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (_memory, _memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (_file, _file))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
_ROOT = os.path.realpath(os.getcwd())
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_NEVER = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
          "os.forkpty", "ctypes.", "_ctypes", "os.kill", "os.killpg", "signal.pthread_kill")
_PATHS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink", "os.link",
          "os.truncate", "os.utime", "os.chdir", "shutil.")
def _inside(path):
    try:
        p = os.path.realpath(os.fsdecode(path) if not isinstance(path, int) else "/proc/self/fd/%d" % path)
    except Exception:
        return False
    return p == _ROOT or p.startswith(_ROOT + os.sep)
def _hook(event, args):
    if event.startswith(_NEVER):
        raise PermissionError(f"{event} is not allowed in this sandbox")
    if event == "open":
        path, mode, flags = (list(args) + [None, None, 0])[:3]
        writing = (mode is not None and any(c in str(mode) for c in "wax+")) or bool((flags or 0) & _WRITE)
        if writing and not _inside(path):
            raise PermissionError(f"writing {path} is not allowed: only files under the working folder")
    elif event.startswith(_PATHS) and args and not _inside(args[0]):
        raise PermissionError(f"{event} on {args[0]} is not allowed: only files under the working folder")
sys.addaudithook(_hook)
del _hook
_code = sys.stdin.read()
exec(compile(_code, "<tool call>", "exec"), {"__name__": "__main__"})
"""


@functools.cache
def _unshare_prefix() -> tuple[str, ...]:
    """``unshare -rn`` when this kernel lets an unprivileged process drop its network, else nothing."""
    tool = shutil.which("unshare")
    if tool is None:
        return ()
    try:
        ok = subprocess.run([tool, "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return (tool, "-rn") if ok else ()


class PythonTool(Tool):
    """Runs Python code in a fresh, limited process and returns what it printed."""

    class Options(Options):
        timeout_s: float = Field(5.0, gt=0, description="Wall-clock seconds a call may take.")
        cpu_s: int = Field(5, gt=0, description="CPU seconds a call may use.")
        memory_mb: int = Field(512, gt=0, description="Address space of the process, in MiB.")
        file_mb: int = Field(16, gt=0, description="Largest file the code may write, in MiB.")
        max_output_chars: int = Field(2000, gt=0, description="Longest output returned to the model.")

    def schema(self) -> dict:
        return {
            "type": "function",
            "function": {
                "name": "python",
                "description": "Run Python code and return what it prints. No network, no files outside its folder.",
                "parameters": {
                    "type": "object",
                    "properties": {"code": {"type": "string", "description": "The program."}},
                    "required": ["code"],
                },
            },
        }

    def __call__(self, arguments: dict) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ValueError('give the program as a string: {"code": "print(1 + 1)"}')
        o = self.options
        folder = tempfile.mkdtemp(prefix="hybridrl-python-")
        env = {"HOME": folder, "TMPDIR": folder, "PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "LANG": "C.UTF-8"}
        limits = [str(o.cpu_s), str(o.memory_mb * 2**20), str(o.file_mb * 2**20)]
        cmd = [*_unshare_prefix(), sys.executable, "-I", "-c", _GUARD, *limits]
        try:
            proc = subprocess.Popen(
                cmd,
                cwd=folder,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            try:
                out, err = proc.communicate(code, timeout=o.timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                raise TimeoutError(f"the program ran longer than {o.timeout_s:g} s and was stopped") from None
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        if proc.returncode == -signal.SIGXCPU or proc.returncode == -signal.SIGKILL:
            raise TimeoutError(f"the program used more than {o.cpu_s} s of CPU and was stopped")
        if proc.returncode != 0:
            last = (err.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
            raise RuntimeError(last[: o.max_output_chars])
        return out[: o.max_output_chars] if out else "(no output)"


@hookimpl
def register_tools(register):
    register("calculator", Calculator)
    register("python", PythonTool)
