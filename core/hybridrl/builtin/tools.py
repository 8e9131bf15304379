"""Built-in tools: ``calculator`` (arithmetic, no code run) and ``python`` (code in a sandbox).

The ``python`` tool runs each call in :mod:`hybridrl.sandbox`: CPython built for WebAssembly, run by
wasmtime in a child process, reaching nothing but a scratch folder, under limits on CPU time, wall
time, memory, file sizes and output. Without wasmtime it refuses to start, unless its options say
``sandbox: none``.
"""

from __future__ import annotations

import ast
import math
import operator
import sys
from typing import Literal

from pydantic import Field

from hybridrl.components import Options, Tool
from hybridrl.hookspecs import hookimpl
from hybridrl.sandbox import HostProcess, Limits, WasmSandbox

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


class PythonTool(Tool):
    """Runs the model's Python code in a WebAssembly sandbox (hybridrl/sandbox.py) and returns what it printed."""

    class Options(Options):
        sandbox: Literal["wasm", "none"] = Field(
            "wasm",
            description="wasm: CPython 3.11 for WebAssembly under wasmtime (standard library only), reaching "
            "only a scratch folder; needs hybridrl[sandbox]. none: a plain python process with the OS "
            "limits below and no isolation: the code can read and write what the trainer can.",
        )
        timeout_s: float = Field(5.0, gt=0, description="Wall-clock seconds a call may take.")
        cpu_s: int = Field(5, gt=0, description="CPU seconds a call may use.")
        memory_mb: int = Field(
            512, gt=0, description="Memory of the program, in MiB (wasm: its linear memory; none: address space)."
        )
        file_mb: int = Field(16, gt=0, description="Largest file the code may write, in MiB.")
        disk_mb: int = Field(64, gt=0, description="All files a call writes together, in MiB (wasm only).")
        max_output_chars: int = Field(2000, gt=0, description="Longest output returned to the model.")

    def __init__(self, options: Options, ctx):
        super().__init__(options, ctx)
        o = self.options
        self._limits = Limits(o.timeout_s, o.cpu_s, o.memory_mb, o.file_mb, o.disk_mb, 4 * o.max_output_chars)
        if o.sandbox == "none":
            print(
                "warning: the python tool runs the model's code without a sandbox (sandbox: none): "
                "it can read and write whatever this process can.",
                file=sys.stderr,
                flush=True,
            )
            self._sandbox = HostProcess()
        else:
            self._sandbox = WasmSandbox()  # SandboxUnavailable, naming the fix, when wasmtime is missing
        self._sandbox.prepare()  # compile now (once per machine): a broken sandbox stops the run here

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
        result = self._sandbox.run(code, self._limits)
        if result.stopped == "wall":
            raise TimeoutError(f"the program ran longer than {o.timeout_s:g} s and was stopped")
        if result.stopped == "cpu":
            raise TimeoutError(f"the program used more than {o.cpu_s} s of CPU and was stopped")
        if result.stopped == "disk":
            raise RuntimeError(f"the program wrote more than {o.disk_mb} MiB of files and was stopped")
        if result.crash:
            raise RuntimeError(f"the program crashed: {result.crash}"[: o.max_output_chars])
        if result.exit_code != 0:
            last = (result.stderr.strip().splitlines() or [f"exit status {result.exit_code}"])[-1]
            raise RuntimeError(last[: o.max_output_chars])
        text = result.stdout[: o.max_output_chars]
        if result.stdout_cut or len(result.stdout) > o.max_output_chars:
            text += f"\n(output cut at {o.max_output_chars} characters)"
        return text or "(no output)"


@hookimpl
def register_tools(register):
    register("calculator", Calculator)
    register("python", PythonTool)
