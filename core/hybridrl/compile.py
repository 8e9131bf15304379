"""torch.compile in one place: what is compiled (the passes' transformer blocks; the hf engine's
decoding step compiles through :func:`allow_recompiles`), when ``compile: auto`` compiles
(:func:`pays_back`), the clock of compile seconds and the reasons of recompilations, and the
console's note on a step that compiled again (:func:`recompiled`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path

import torch

from hybridrl.models import find_blocks

# A second run of a model shape loads what the first compiled from the compile cache: the hf engine's
# decoding on the real task took 13.6 s at step 1 where the first run compiled for 47.8 s (2026-12-06, one
# H100, trainer.compile_cache), so with the cache warm compiling pays back after about 0.3 of the tokens.
# A step saved precompiled (torch 2.13) loads instead: 1.0 s at step 1 against 42.4 s, and that step 1
# took 1.45 s against eager's 3.8 s (2026-12-08, one H100), so auto then compiles for any run length.
WARM_SHARE = 0.3
SAVED_VARIANTS = 8  # files of a precompiled step kept for one key (a variant: a sampling setting, one row)
_pending: dict[str, Path] = {}  # option -> the marker written once a step has compiled under it
_saved: set[str] = set()  # the options whose step this run saved precompiled (Precompiled)


def pays_back(choice: str, option: str, ctx, planned: int | None, threshold: int, counted: str, key=()) -> bool:
    """Whether a ``compile`` option (``option``, e.g. ``sharding.compile``) set to ``choice`` compiles:
    on and off say so; auto compiles on a CUDA device when the run's ``planned`` tokens (None: no
    planned end) reach ``threshold``, about what a first step's compiling costs in eager tokens, or
    ``WARM_SHARE`` of it where the compile cache holds what an earlier run of this model shape (and
    ``key``, the option's own settings) compiled (:func:`remember_compiled`), and whatever the run's
    length where that run saved its step precompiled (:class:`Precompiled`: it loads in about a second);
    it says on the main rank what it chose and why (``counted``: what the planned tokens are)."""
    marker = _keyed("hybridrl-compiled", ctx, option, *key, _code()) if ctx.device.type == "cuda" else None
    marker = marker and marker.with_suffix(".json")  # only predicts a short compile: torch keys each graph
    warm = marker is not None and marker.is_file()
    loads = warm and _read(marker).get("precompiled") is True
    cache = (
        f" (the compile cache holds what an earlier run of this model compiled: {marker.parent.parent})" if warm else ""
    )
    threshold = 0 if loads else int(threshold * WARM_SHARE) if warm else threshold
    if choice != "auto":
        on = choice == "on"
    elif ctx.device.type != "cuda":
        return False
    elif planned is None or planned >= threshold:
        on = True
        if ctx.is_main:
            why = "has no planned end" if planned is None else f"plans about {planned:,} {counted}"
            why = "finds the step an earlier run of this model precompiled" if loads else why
            first = "loads it" if loads else "compiles"
            print(f"{option} auto: on, as the run {why}{cache}: the first step {first}; set {option}: off to stay "
                  "eager", flush=True)  # fmt: skip
    else:
        on = False
        if ctx.is_main:
            print(
                f"{option} auto: off, as the run plans about {planned:,} {counted}, under the {threshold:,} that pay "
                f"back compiling{cache}; set {option}: on to compile anyway",
                flush=True,
            )
    if on and marker is not None and not loads:
        _pending[option] = marker
    return on


def _read(marker: Path) -> dict:
    with contextlib.suppress(OSError, ValueError):
        return json.loads(marker.read_text())
    return {}


@functools.cache
def _hybridrl_code() -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(Path(__file__).parent.rglob("*.py")))).hexdigest()


def _code() -> str:
    """hybridrl's code and transformers' version: in the key of whatever compiled code is kept for later runs."""
    import transformers

    return f"{_hybridrl_code()}-{transformers.__version__}"


def _keyed(kind: str, ctx, *parts) -> Path | None:
    """A path under ``kind`` in the compile cache in use (None: torch's own temporary folder), keyed
    by the model's shape (its config.json and any code of its own), dtype, GPU, torch and ``parts``."""
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not folder:
        return None
    model = Path(ctx.model_path)
    shape = b"".join(p.read_bytes() for p in sorted([model / "config.json", *model.glob("*.py")]) if p.is_file())
    gpu = torch.cuda.get_device_name(ctx.device) if torch.cuda.is_available() else ctx.device.type
    parts = (torch.__version__, *parts, ctx.dtype, gpu)
    key = hashlib.sha256(b"\0".join(str(x).encode() for x in parts) + (shape or str(model).encode()))
    return Path(folder) / kind / key.hexdigest()[:32]


def remember_compiled() -> None:
    """After the first step: mark the compile cache warm for the options that compiled in it."""
    if compile_seconds() > 0:
        for option, marker in _pending.items():
            marker.parent.mkdir(parents=True, exist_ok=True)
            saved = {"option": option, "torch": torch.__version__, "at": time.time(), "precompiled": option in _saved}
            marker.write_text(json.dumps(saved) + "\n")
    _pending.clear()
    _saved.clear()


def use_cache(choice: str | None) -> Path | None:
    """Point torch.compile's caches (inductor's compiled graphs and, under it, Triton's kernels) at
    ``choice`` (``trainer.compile_cache``), set for this process and the ones it starts: ``auto`` keeps
    ``TORCHINDUCTOR_CACHE_DIR`` where set, else hybridrl's cache folder; None leaves torch's default."""
    from hybridrl.models import cache_dir

    _pending.clear()  # a new run: what an earlier one was to mark is not this one's
    _saved.clear()
    if choice is None:
        return None
    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR") if choice == "auto" else None
    given = None if given == _torchs_default() else given  # torch sets its own default at its first use
    folder = Path(given or (cache_dir() / "torch-compile" if choice == "auto" else choice)).expanduser()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    os.environ.setdefault("TRITON_CACHE_DIR", str(folder / "triton"))
    return folder


def _torchs_default() -> str | None:
    with contextlib.suppress(ImportError):
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        return os.path.abspath(default_cache_dir())
    return None


def compile_blocks(model: torch.nn.Module) -> None:
    """torch.compile each transformer block of ``model``, one compiled graph for every number of rows.

    The first dimension of a block's inputs (the rows of a pass: packed rows, or responses) is
    dynamic from the first call, so passes of other row counts reuse the graph instead of compiling
    again mid-run; the others stay static, as the pass runner keeps a run's packed rows one width
    (:attr:`hybridrl.components.ShardingStrategy.pack_width`): graphs of a dynamic width ran 1.6x
    slower on an H200 (BENCHMARKS.md). A pass of one row compiles a graph of its own (torch.compile
    specialises sizes 0 and 1). A call that carries a KV cache (a pass that shares its prompts,
    ``trainer.share_prompts``) runs eagerly: the cache's state, per layer, made a graph for each layer,
    64 for SmolLM2 on a CPU, when torch stopped compiling (75 s of compiling at step 1)."""
    allow_recompiles()
    fuse_whatever_the_size()
    for block in find_blocks(model):
        block.forward = _rows_dynamic(torch.compile(block.forward), block.forward)


def fuse_whatever_the_size() -> None:
    """Inductor's mix-order reduction (a norm's two backward reductions, over rows and over columns, in
    one kernel) is chosen for passes of at least 5 Mi elements, a test that with the rows dynamic became
    a guard on them: the first pass across it compiled the blocks again mid-run (an H200, 1024-token
    responses: 5.3 s at step 2, ``1032192*hidden_states.size()[0] >= 5242880``). Its non-strict mode
    skips those size tests, so one graph serves passes of every size. The setting is the process's, as
    :func:`allow_recompiles`; where torch has no such mode, nothing changes."""
    import torch._inductor.config as inductor

    if hasattr(inductor.triton, "mix_order_reduction_non_strict_mode"):
        inductor.triton.mix_order_reduction_non_strict_mode = True


def _rows_dynamic(compiled, eager):
    def forward(*args, **kwargs):
        if kwargs.get("past_key_values", kwargs.get("past_key_value")) is not None:
            return eager(*args, **kwargs)
        tensors = [t for t in (*args, *kwargs.values()) for t in (t if isinstance(t, tuple) else (t,))]
        tensors = [t for t in tensors if isinstance(t, torch.Tensor) and t.dim()]
        rows = tensors[0].shape[0] if tensors else 0
        if rows > 1:
            for t in tensors:
                if t.shape[0] == rows:
                    torch._dynamo.maybe_mark_dynamic(t, 0)
        return compiled(*args, **kwargs)

    return forward


class Precompiled:
    """``fn`` compiled whole ahead of time (torch's AOT precompile), each variant saved in the compile
    cache, keyed by the model (:func:`_keyed`), ``key`` (the option first: a run that saved a step marks
    it so, for :func:`pays_back`), ``fn``'s and hybridrl's code and transformers, for the next run to load
    without tracing, which inductor's cache does not keep: a second run compiled the hf engine's
    decoding for 14.0 s, 10.4 s of it tracing; loaded, 3.0 s (SmolLM2, 2 CPU cores; 1.0 s on an H100).
    A call runs the first variant whose guards (shapes, dtypes, constants read) pass, else compiles
    one, ``mark(True, *args)`` marking dynamic dimensions for that alone. Where ``fn`` cannot be
    compiled whole or saved (or not ``aot``), it compiles as torch.compile does, in each run."""

    def __init__(self, fn, ctx, mark, key: tuple = (), aot: bool = True):
        import inspect

        source = hashlib.sha256(Path(inspect.getsourcefile(fn)).read_bytes()).hexdigest()  # fn's code
        aot = aot and hasattr(torch.compile(fn), "aot_compile")  # torch 2.13 has it, 2.11 not
        self.folder = _keyed("hybridrl-precompiled", ctx, *key, _code(), source) if aot else None
        self.option = key[0] if key else None
        self.fn, self.mark, self.variants, self.files = fn, mark, [], set()
        self.fallback = None if aot else torch.compile(fn)
        self.load()

    def load(self) -> None:
        """Load the variants saved in the folder since the last load, by any process (``load_s``: seconds)."""
        start, count = time.perf_counter(), len(self.variants)
        for path in sorted(self.folder.glob("*.aot")) if self.folder and self.folder.is_dir() else []:
            if path.name not in self.files:
                self.files.add(path.name)
                with contextlib.suppress(Exception), path.open("rb") as f:  # a torn or foreign file compiles again
                    self.variants.append(torch.compiler.load_compiled_function(f))
        self.load_s = time.perf_counter() - start if len(self.variants) > count else 0.0
        _compile_clock().seconds += time.perf_counter() - start

    def __call__(self, *args):
        for variant in self.variants:
            if variant.guard_check(*args):
                return variant.fn(*args)
        self.mark(True, *args)
        if self.fallback is None:
            start = time.perf_counter()
            try:
                variant = torch.compile(self.fn, fullgraph=True, options={"guard_filter_fn": _portable})
                variant = variant.aot_compile((args, {}))
                if self.folder and len(self.variants) < SAVED_VARIANTS:  # a step loaded and never passing its guards
                    self.folder.mkdir(parents=True, exist_ok=True)  # again (Phi-3's) must not fill the disk
                    self.files.add(name := f"{os.getpid()}-{time.time_ns()}.aot")
                    variant.save_compiled_function(str(self.folder / name))
                    _saved.add(self.option)
            except Exception as e:  # noqa: BLE001 - a graph break, a guard torch cannot save, an older torch
                why = (str(e).strip().splitlines() or [""])[0][:160]
                print(f"note: {self.fn.__name__} cannot be precompiled ({type(e).__name__}: {why}); it compiles "
                      "in each run", flush=True)  # fmt: skip
                self.fallback = torch.compile(self.fn)
            else:
                self.mark(False, *args)
                self.variants.append(variant)
                return variant.fn(*args)
            finally:
                _compile_clock().seconds += time.perf_counter() - start
        return self.fallback(*args)


def _portable(guards) -> list[bool]:
    """The guards a saved variant keeps: not those on objects' identity (modules, functions, globals),
    which torch cannot save, nor on functions' defaults (a method set on the instance, as
    rope.pin_long_rope sets Phi-3's, is read from the class once loaded); the folder's key stands for them."""
    from torch._dynamo.guards import CheckFunctionManager

    unsaved = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    types = [{g.guard_type, *getattr(g, "derived_guard_types", ())} for g in guards]
    return [not (g.is_global or unsaved & t or g.name.endswith("__defaults__")) for g, t in zip(guards, types)]


def compile_seconds() -> float:
    """Seconds this process has spent in torch.compile since the first call: tracing and compiling
    forward graphs, and backward graphs (compiled at their first backward pass, or within the
    forward's compilation). torch reports each compilation's start and end once, however its phases
    nest (:class:`_CompileClock`); a torch without that report gives 0."""
    clock = _compile_clock()
    clock.listen()  # again after a torch._dynamo.reset(), which drops the callbacks
    return clock.seconds


def recompile_reasons() -> list[str]:
    """torch.compile's recompilations since the last call, one line each: the function and the
    first guard that failed, e.g. ``forward (modeling_qwen2.py:261): tensor
    'past_key_values.layers[0].keys' size mismatch at index 2. expected 128, actual 132``. Heard
    from torch's ``recompiles`` log, kept quiet unless ``TORCH_LOGS=recompiles`` asks for it too; a
    torch without that log gives none."""
    clock = _compile_clock()
    clock.listen()
    reasons, clock.reasons = clock.reasons, []
    return reasons


def _reason_line(message: str) -> str:
    lines = message.splitlines()
    where = re.match(r"Recompiling function (\S+) in (.+):(\d+)", lines[0])
    failed = next((line.strip()[2:] for line in lines[1:] if line.strip().startswith("- ")), "")
    failed = re.sub(r"^\d+/\d+: ", "", failed).split("  #")[0].strip()
    return f"{where[1]} ({Path(where[2]).name}:{where[3]}): {failed}" if where else lines[0]


class _CompileClock(logging.Handler):
    """The wall-clock seconds between torch.compile's outermost start and end reports (summing
    torch's per-phase records instead counted a backward graph compiled inside its forward's
    compilation twice: 83 s of compiling in a 70 s run), and the reasons of its recompilations."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.seconds, self._start, self.reasons = 0.0, None, []
        self.listen()

    def listen(self) -> None:
        handler = getattr(torch._dynamo, "callback_handler", None)
        if handler is not None and self._started not in handler.start_callbacks:
            handler.register_start_callback(self._started)
            handler.register_end_callback(self._ended)
        log = logging.getLogger("torch._dynamo.guards.__recompiles")  # torch's "recompiles" artifact
        if self not in log.handlers:
            try:  # torch's private logging state: a torch without it gives no reasons
                from torch._logging._internal import log_state

                if not log_state.is_artifact_enabled("recompiles"):  # on for this handler alone, quiet
                    log_state.enable_artifact("recompiles")
                    log.propagate = False
            except (ImportError, AttributeError):
                return
            log.setLevel(logging.DEBUG)
            log.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.reasons = [*self.reasons[-15:], _reason_line(record.getMessage())]

    def _started(self, _args) -> None:
        self._start = time.perf_counter()

    def _ended(self, _args) -> None:
        if self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self._start = None


@functools.cache
def _compile_clock() -> _CompileClock:
    return _CompileClock()


RECOMPILE_LIMIT = 64  # graphs torch.compile keeps for one function once hybridrl compiles


def allow_recompiles(limit: int = RECOMPILE_LIMIT) -> None:
    """Let torch.compile keep up to ``limit`` graphs for each function (its default is 8).

    A compiled transformer block serves every layer of the policy and the reference model, and
    their passes reach it in many variants, each with a graph of its own: with and without
    gradients, with an attention mask (packed rows of several sequences, left-padded rows) or
    without one (rows that one sequence fills), a first static graph and then a dynamic one, one
    row (specialised). Likewise the hf engine's decoding step for each row count. Past the limit
    torch.compile runs every further variant eagerly for the rest of the process (a warning, once).
    The setting is the process's; it is only ever raised."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, limit)
    _compile_clock().listen()  # compile_seconds counts from here on


def recompiled(step: int, seconds: float, reasons: list[str]) -> str:
    """The console's note on a step after the first that compiled again, with torch's reasons."""
    seen = list(dict.fromkeys(reasons))
    more = f"; and {len(seen) - 3} more" if len(seen) > 3 else ""
    return (
        f"step {step}: torch.compile compiled again ({len(reasons)}x, {seconds:.1f}s): {'; '.join(seen[:3])}{more}. "
        "Set TORCH_LOGS=recompiles for the whole reasons; docs/observability.md, 'A slow step'."
    )
