"""``rollout.compile: background``: the ``hf`` engine's decoding step compiled by a process of its own (the engine
with the run's options, two rows of the same lengths and sampling, the step saved in the compile cache) while the
engine decodes eagerly. Not a thread: torch.compile holds the interpreter's lock while it traces and sets the random
generator back when it ends (docs/performance.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

import torch

from hybridrl.lora import has_adapter


class Background:
    """The engine's compiling child and the calls decoded eagerly meanwhile (``eager_calls``)."""

    def __init__(self):
        self.child, self.log, self.tried, self.eager_calls = None, None, set(), 0  # tried: kinds of call a child ran
        self.room, self.main = True, False  # room: False where the device has none for a child (decoding stays eager)

    def compiled_now(self, engine, loop, sampling, warpers) -> bool:
        """Whether this call of ``engine`` decodes compiled: a saved step passes its guards, or no child can help
        (no compile cache, adapters synced unmerged, or one ran for a call of this kind and its step did not pass:
        the call then compiles, as without background). Else a child compiles it while the call decodes eagerly."""
        step, kind = engine._precompiled, (engine._graph_key(0, sampling, True), loop.rows == 1)
        if self.child is not None and self.child.poll() is not None:  # done: what it saved is loaded
            step.load()
            engine._compile_s += step.load_s
            said = f"compiled in the background, loaded in {step.load_s:.1f} s ({self.eager_calls} eager calls before)"
            if self.child.returncode:  # its last line says why
                self.log.seek(0)
                last = ([line for line in self.log.read().decode(errors="replace").splitlines() if line] or [""])[-1]
                said = f"compiling in the background failed ({last[:200]}); the step compiles when called"
            if engine.ctx.is_main:
                print(f"rollout.compile: {said}", flush=True)
            self.log.close()
            self.child = self.log = None
        args = (engine.model, loop, sampling, warpers, engine._is_end, engine.pad_id)
        ready = step.fallback or any(v.guard_check(*args) for v in step.variants)
        helps = step.folder and not has_adapter(engine.model)  # unmerged adapters: the child's model has none
        if ready or (self.child is None and self.room and (kind in self.tried or not helps)):  # the call compiles
            return True
        if self.child is None and self.room:
            self.tried.add(kind)
            self.start(engine, loop, sampling)
        self.eager_calls += 1
        return False

    def start(self, engine, loop, sampling) -> None:
        ctx, (prompt, tokens), cls = engine.ctx, loop.lengths, type(engine)
        self.main = ctx.is_main
        need = sum(p.numel() * p.element_size() for p in engine.model.parameters()) + 2**30  # weights, cache, context
        free = torch.cuda.mem_get_info(ctx.device)[0] if ctx.device.type == "cuda" else need
        if free < need:  # a second copy of the weights would not fit beside the run's
            self.room = False
            if ctx.is_main:
                print(f"rollout.compile: background: {ctx.device} has {free / 2**30:.1f} GiB free, under the "
                      f"{need / 2**30:.1f} GiB of a process that compiles the step (the engine's weights again): "
                      "decoding stays eager; rollout.compile: on compiles it in this process", flush=True)  # fmt: skip
            return
        child = {"compile": "on", "compile_after": 1, "graph_tokens": 0, "batch_size": 0}  # none change the step
        spec = {
            "model": ctx.model_path, "device": str(ctx.device), "dtype": str(ctx.dtype).split(".")[-1],
            "trust_remote_code": ctx.trust_remote_code, "rows": min(loop.rows, 2), "prompt": prompt, "tokens": tokens,
            "options": engine.options.model_dump(mode="json") | child, "engine": [cls.__module__, cls.__name__],
            "sampling": {k: getattr(sampling, k) for k in ("temperature", "top_k", "top_p", "ignore_eos")},
        }  # fmt: skip
        self.log = tempfile.NamedTemporaryFile()  # its output, for the line that says why it failed
        command = [sys.executable, "-m", "hybridrl.builtin.hf_background", json.dumps(spec)]
        env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # hybridrl as this process has it
        out = {"stdout": self.log, "stderr": subprocess.STDOUT, "stdin": subprocess.DEVNULL}
        self.child = subprocess.Popen(command, env=env, **out)
        if ctx.is_main:
            print("rollout.compile: compiling the decoding step in the background (a process of its own); decoding "
                  "eagerly until it is ready", flush=True)  # fmt: skip

    def close(self) -> None:
        """A child still compiling goes on: it saves the step for the next run of this model, then exits (``main``)."""
        if self.child is not None and self.child.poll() is None and self.main:
            print(f"rollout.compile: the background compile (process {self.child.pid}) goes on after the run: it saves "
                  "the step for the next run of this model, then exits", flush=True)  # fmt: skip


def main(spec: dict) -> None:
    os.nice(19)  # the run's own processes first: it compiles on what they leave idle
    signal.alarm(900)  # and within 15 minutes, or not at all

    from hybridrl.components import RunContext, SamplingParams
    from hybridrl.models import load_tokenizer

    tokenizer = load_tokenizer(spec["model"], spec["trust_remote_code"])
    device, dtype, trust = torch.device(spec["device"]), getattr(torch, spec["dtype"]), spec["trust_remote_code"]
    ctx = RunContext(spec["model"], tokenizer, device, dtype, 0, tempfile.mkdtemp(), trust_remote_code=trust)
    ctx.join(prompt_tokens=spec["prompt"])
    engine_class = getattr(__import__(spec["engine"][0], fromlist=["_"]), spec["engine"][1])  # no import cycle
    engine = engine_class(engine_class.Options(**spec["options"]), ctx)
    prompts = [[engine.pad_id or 0] * spec["prompt"]] * spec["rows"]  # their shape alone matters
    engine.generate(prompts, SamplingParams(n=1, max_tokens=spec["tokens"], seed=0, **spec["sampling"]))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
