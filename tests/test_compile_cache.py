"""trainer.compile_cache: where torch.compile keeps what it compiled, across runs. A second process
loads a graph compiled before from that folder instead of compiling it again, and never a graph of
another dtype, shape or compiler setting (torch keys its cache by them, and by its version)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from hybridrl.compile import use_cache

# each process compiles the same small graph first, then (the second) other variants of it, and prints
# torch's count of graphs loaded from the cache and compiled anew
PROBE = textwrap.dedent(
    """
    import sys, torch
    from hybridrl.compile import use_cache
    use_cache(sys.argv[1])

    def graph(dtype, cols):
        f = torch.compile(lambda x: torch.nn.functional.gelu(x @ x.T).sum(-1), dynamic=False)
        f(torch.ones(8, cols, dtype=dtype))

    graph(torch.float32, 16)
    if sys.argv[2] == "variants":
        graph(torch.float64, 16)  # another dtype
        graph(torch.float32, 32)  # another shape
        torch._dynamo.reset()  # traced again: the same graph and settings load from the folder
        graph(torch.float32, 16)
        torch._dynamo.reset()
        with torch._inductor.config.patch(epilogue_fusion=False):  # another compiler setting
            graph(torch.float32, 16)
    from torch._dynamo.utils import counters
    print(counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"])
    """
)


def test_auto_takes_hybridrls_cache_folder_unless_torchs_variable_names_one(tmp_path, monkeypatch):
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HYBRIDRL_CACHE", str(tmp_path / "hybridrl"))
    assert use_cache(None) is None and "TORCHINDUCTOR_CACHE_DIR" not in os.environ  # torch's default
    assert use_cache("auto") == tmp_path / "hybridrl" / "torch-compile"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "hybridrl" / "torch-compile")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "hybridrl" / "torch-compile" / "triton")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_cache("auto") == tmp_path / "mine"  # the user's variable stays
    assert use_cache(str(tmp_path / "set")) == tmp_path / "set"  # a folder given in the config wins
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "set")


def test_a_second_process_loads_what_the_first_compiled_and_nothing_of_another_key(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)

    def run(what: str) -> tuple[int, int]:
        env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
        done = subprocess.run([sys.executable, str(script), str(tmp_path / "cache"), what], env=env,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        hits, misses = done.stdout.split()[-2:]
        return int(hits), int(misses)

    assert run("first") == (0, 1)  # compiled, and kept in the folder
    assert any((tmp_path / "cache").rglob("*"))
    assert run("variants") == (2, 3)  # the same graph loaded (twice); dtype, shape and setting compiled anew
