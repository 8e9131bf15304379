"""The ``python`` tool: the model's code run in :mod:`hybridrl_reward_python.sandbox`, CPython built
for WebAssembly, run by wasmtime in a child process, reaching nothing but a scratch folder, under
limits on CPU time, wall time, memory, file sizes and output. Without wasmtime it refuses to start,
unless its options say ``sandbox: none``.
"""

from __future__ import annotations

import sys
from typing import Literal

from pydantic import Field

from hybridrl.components import Options, Tool
from hybridrl_reward_python.sandbox import HostProcess, Limits, WasmSandbox


class PythonTool(Tool):
    """Runs the model's Python code in a WebAssembly sandbox (hybridrl_reward_python/sandbox.py) and
    returns what it printed."""

    class Options(Options):
        sandbox: Literal["wasm", "none"] = Field(
            "wasm",
            description="wasm: CPython 3.11 for WebAssembly under wasmtime (standard library only), reaching "
            "only a scratch folder; needs hybridrl-reward-python[sandbox]. none: a plain python process with the OS "
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
