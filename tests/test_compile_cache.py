"""trainer.compile_cache: where torch.compile keeps what it compiled, across runs. A second process
loads a graph compiled before from that folder instead of compiling it again, and never a graph of
another dtype, shape or compiler setting (torch keys its cache by them, and by its version). The hf
engine's decoding step is kept whole (precompiled): a second process loads it without tracing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

from torch._inductor.runtime import cache_dir_utils

from hybridrl.compile import use_cache

# the hf engine's compiled decoding in a new process: sys.argv = cache folder, model, dtype, settings
DECODE = textwrap.dedent(
    """
    import sys, torch
    from torch._dynamo.utils import counters
    from hybridrl import plugins
    from hybridrl.compile import compile_seconds, use_cache
    from hybridrl.components import RunContext, SamplingParams
    from hybridrl.models import load_tokenizer
    use_cache(sys.argv[1])
    tok = load_tokenizer(sys.argv[2])
    ctx = RunContext(sys.argv[2], tok, torch.device("cpu"), getattr(torch, sys.argv[3]), 0, sys.argv[1])
    cls = plugins.lookup("rollout engine", "hf")
    engine = cls(cls.Options(cache="static", compile="on", compile_after=1), ctx)
    prompts = [tok.encode(t) for t in ("The sky is", "One two three four")]
    for temperature in sys.argv[4].split(","):  # each setting a variant of the step
        out = engine.generate(prompts, SamplingParams(n=2, max_tokens=12, seed=1, temperature=float(temperature)))
        print("tokens", out.token_ids, "hf/compile_s", engine.metrics()["hf/compile_s"] > 0)  # compiled or loaded
    print("graphs", counters["stats"]["unique_graphs"], "compile_s", compile_seconds() > 0)
    """
)

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
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    torchs_own = cache_dir_utils.cache_dir()  # torch's default (a folder of /tmp), which it sets at its first use
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == torchs_own  # as it did on a GPU machine before the run started
    assert use_cache("auto") == tmp_path / "hybridrl" / "torch-compile"  # not a variable the user set: ours
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


def test_a_second_process_loads_the_hf_engines_decoding_step_without_tracing_it(tmp_path, tiny_model):
    """The first run compiles the step and saves it; the second loads it (torch traces nothing) and
    samples the same tokens; a sampling setting the saved step's guards do not pass compiles a step of
    its own, and another dtype never sees the folder. A torn file there is passed over."""
    script, cache = tmp_path / "decode.py", tmp_path / "cache"
    script.write_text(DECODE)

    def run(dtype: str, temperatures: str) -> tuple[list[str], str]:
        env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
        done = subprocess.run([sys.executable, str(script), str(cache), str(tiny_model), dtype, temperatures],
                              env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        lines = done.stdout.splitlines()
        return [line for line in lines if line.startswith("tokens")], lines[-1]

    tokens, counted = run("float32", "1.0")
    assert counted == "graphs 1 compile_s True"
    (saved,) = (cache / "hybridrl-precompiled").glob("*/*.aot")
    (saved.parent / "torn.aot").write_bytes(saved.read_bytes()[:1000])
    again, counted = run("float32", "1.0,0.5")  # one graph: 1.0's loaded (else two), 0.5 compiled its own
    assert again[0] == tokens[0] and counted == "graphs 1 compile_s True"
    assert again[0].endswith("hf/compile_s True")  # the engine counts loading the step as compile time
    assert len(list(saved.parent.glob("*.aot"))) == 3


def test_the_precompiled_steps_folder_changes_with_whatever_its_guards_do_not_check(tmp_path, tiny_model, monkeypatch):
    """A saved step's guards check its inputs' shapes, dtypes and the constants it read, not the code it
    runs: the folder's key does (the model's config and code, dtype, device, torch, transformers, the
    step's code and hybridrl's), so a step is never loaded where one of those differs."""
    import shutil

    import torch
    import transformers

    from hybridrl import compile
    from hybridrl.builtin.hf_fast_path import decode_step
    from hybridrl.components import RunContext

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)

    def folder(dtype=torch.float32, step=decode_step, key=("rollout.compile", "{}")):
        ctx = RunContext(str(model), None, torch.device("cpu"), dtype, 0, tmp_path)
        return compile.Precompiled(step, ctx, None, key).folder

    first = folder()
    assert first.parent == tmp_path / "cache" / "hybridrl-precompiled" and folder() == first
    assert folder(torch.bfloat16) != first
    assert folder(step=lambda *args: None) != first  # other code (this file's)
    assert folder(key=("rollout.compile", '{"fuse_projections": false}')) != first  # the engine's options
    monkeypatch.setattr(transformers, "__version__", "0.0.1")
    assert folder() != first
    monkeypatch.undo()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert folder() != first
    monkeypatch.undo()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    (model / "modeling_mine.py").write_text("# a model's own code\n")
    assert folder() != first
    config = (model / "config.json").read_text()
    (model / "modeling_mine.py").unlink()
    assert folder() == first
    (model / "config.json").write_text(config.replace("{", '{"rope_theta": 12.5, ', 1))
    assert folder() != first


def _double(x):
    return x * 2


def test_a_torch_without_aot_precompile_compiles_in_each_run_and_keeps_no_folder(tmp_path, monkeypatch):
    """torch 2.11's compiled functions have no aot_compile: the step then compiles as torch.compile does, in each
    run, with no precompiled folder (so compile: background starts no child whose step could never load)."""
    import torch

    from hybridrl.compile import Precompiled

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: lambda *a: compile_(fn, **kw)(*a))  # as 2.11's
    ctx = SimpleNamespace(model_path=str(tmp_path), dtype=torch.float32, device=torch.device("cpu"))
    step = Precompiled(_double, ctx, lambda *a: None)
    assert step.folder is None and step.fallback is not None and not step.variants
    monkeypatch.setattr(torch, "compile", compile_)  # where torch has it: a folder in the compile cache
    assert Precompiled(_double, ctx, lambda *a: None).folder.is_relative_to(tmp_path / "hybridrl-precompiled")


def test_compile_auto_compiles_a_run_of_any_length_once_an_earlier_run_saved_its_step_precompiled(
    tiny_model, tmp_path, capsys, monkeypatch
):
    """A run whose first step saved the decoding step precompiled marks the compile cache so: a later run
    of the model with the same engine options compiles under auto whatever its length (the step loads in
    about a second, 1.0 s on an H100); a run that compiled without saving, or other engine options, or
    an adapter on the model, or other sampling settings (a variant each), keep the rule by planned tokens."""
    import dataclasses
    import json

    import torch

    from hybridrl import compile as compile_module
    from hybridrl.builtin.hf_fast_path import COMPILE_PAYS_TOKENS, compile_pays
    from hybridrl.components import RunContext
    from hybridrl.config import LoraOptions
    from hybridrl.sampling import Sampling

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(compile_module, "_pending", {})
    monkeypatch.setattr(compile_module, "_saved", set())
    monkeypatch.setattr(compile_module, "compile_seconds", lambda: 40.0)  # each run's first step compiled
    ctx = RunContext(tiny_model, None, torch.device("cuda"), torch.float32, 0, tmp_path)
    short = dataclasses.replace(ctx, steps=10, responses_per_call=8, response_tokens=64, sampling=Sampling())
    assert 10 * 8 * 64 < compile_module.WARM_SHARE * COMPILE_PAYS_TOKENS  # a short run, even with the cache warm
    assert not compile_pays("auto", short, "{}")
    assert compile_pays("on", short, "{}")
    compile_module.remember_compiled()  # its step compiled and was not saved
    (marker,) = (tmp_path / "cache" / "hybridrl-compiled").iterdir()
    assert json.loads(marker.read_text())["precompiled"] is False
    assert not compile_pays("auto", short, "{}")  # inductor's cache alone: still the rule by tokens

    assert compile_pays("on", short, "{}")  # the next run compiles and saves its step
    cpu = dataclasses.replace(ctx, device=torch.device("cpu"))
    step = compile_module.Precompiled(_double, cpu, lambda *a: None, ("rollout.compile", "{}"))
    assert step(torch.arange(3.0)).tolist() == [0.0, 2.0, 4.0] and step.variants
    compile_module.remember_compiled()
    assert json.loads(marker.read_text())["precompiled"] is True
    capsys.readouterr()
    assert compile_pays("auto", short, "{}")
    said = capsys.readouterr().out
    assert "rollout.compile auto: on, as the run finds the step an earlier run of this model precompiled" in said
    assert "the first step loads it" in said
    assert not compile_pays("auto", short, '{"fuse_projections": "off"}')
    assert not compile_pays("auto", dataclasses.replace(short, lora=LoraOptions()), "{}")
    assert not compile_pays("auto", dataclasses.replace(short, dtype=torch.bfloat16), "{}")
    assert not compile_pays("auto", dataclasses.replace(short, sampling=Sampling(temperature=0.7)), "{}")
    assert not compile_pays("auto", dataclasses.replace(short, device=torch.device("cpu")), "{}")  # CPU: eager
