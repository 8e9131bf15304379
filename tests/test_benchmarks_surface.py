"""The benchmarks are clients of hybridrl: every script under benchmarks/ uses the public surface
alone, so that a change inside the trainer never breaks one and a figure measures what a user runs.

The surface: a run (``hybridrl.run``: ``build_run``, ``Run`` and its parts), the loop
(``hybridrl.trainer.Trainer`` and its public methods), ``hybridrl.config.load_config``, the testing
helpers (``hybridrl_testing``, ``hybridrl_testing.models``), the
plugin contract (``hybridrl.components``, ``hybridrl.batch.Batch``, ``hybridrl.plugins``' lookup and
build and the registering of a plugin in code, ``hybridrl.hookspecs.hookimpl``) and a plugin's own
public modules (``hybridrl_rollout_vllm.local``: a benchmark of that plugin). Checked with ``ast``:
what a script imports, that it never calls ``setup()`` or ``evaluate_only``, never touches a private
attribute (``x._name``) and never reads a Trainer attribute outside the loop's methods.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").rglob("*.py"))

ANY = None  # every public name of the module
ALLOWED = {
    "hybridrl": {"__version__"},
    "hybridrl.run": {"build_run", "Run"},
    "hybridrl.trainer": {"Trainer"},
    "hybridrl.config": {"load_config"},
    "hybridrl_testing": ANY,
    "hybridrl_testing.models": ANY,
    "hybridrl.components": ANY,
    "hybridrl.batch": {"Batch"},
    "hybridrl.plugins": {"lookup", "build", "get_plugin_manager", "invalidate_registry", "PluginError"},
    "hybridrl.hookspecs": {"hookimpl"},
    "hybridrl.flops": {"forward_flops", "peak_flops"},  # the FLOPs the trainer's MFU counts, and the peak
}
# what a script may use of a Trainer: the loop's public methods, its run and its config
TRAINER = {"train", "step", "train_on", "sync", "save", "evaluate", "log", "open", "close", "run", "config"}
REMOVED = {"setup", "evaluate_only"}  # the old Trainer's setup, gone with TrainerSetup


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def module_problem(module: str) -> str | None:
    """Why importing ``module`` breaks the surface, or None."""
    if module.startswith("hybridrl_"):  # a plugin's package: its public modules
        return f"private module {module}" if any(private(p) for p in module.split(".")) else None
    if module != "hybridrl" and not module.startswith("hybridrl."):
        return None
    if module not in ALLOWED:
        return f"imports {module}, not the public surface"
    return None


def name_problem(module: str, name: str) -> str | None:
    """Why using ``module.name`` breaks the surface, or None (``module``: an allowed one)."""
    if module.startswith("hybridrl_"):
        return f"private name {module}.{name}" if private(name) else None
    if module not in ALLOWED:
        return None
    allowed = ALLOWED[module]
    if f"{module}.{name}" in ALLOWED:  # from hybridrl import plugins: a module of its own
        return None
    if private(name) or (allowed is not ANY and name not in allowed):
        return f"uses {module}.{name}, not the public surface"
    return None


class Checker(ast.NodeVisitor):
    """The problems of one script: each a line number and what is wrong."""

    def __init__(self):
        self.problems: list[tuple[int, str]] = []
        self.modules: dict[str, str] = {}  # local name -> the hybridrl module it is bound to
        self.trainers: set[tuple[str, str]] = set()  # names (and self.x) holding a Trainer, in their scope
        self.scopes: list[str] = []  # the classes and functions the visit is in

    def report(self, node, text: str) -> None:
        self.problems.append((node.lineno, text))

    def visit_Import(self, node):
        for alias in node.names:
            if problem := module_problem(alias.name):
                self.report(node, problem)
            if alias.name.startswith("hybridrl"):
                self.modules[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )

    def visit_ImportFrom(self, node):
        module = node.module or ""
        if problem := module_problem(module):
            self.report(node, problem)
            return
        for alias in node.names:
            full = f"{module}.{alias.name}"
            if problem := name_problem(module, alias.name):
                self.report(node, problem)
            elif full in ALLOWED or module.startswith("hybridrl_"):  # a module (or a name) of the surface
                self.modules[alias.asname or alias.name] = full

    def visit_Call(self, node):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in REMOVED:
            self.report(node, f"calls .{func.attr}(): the old Trainer's; build_run builds the run")
        name = ast.unparse(func)
        if name.split(".")[-1] == "Trainer" and self.old_trainer_call(node):
            self.report(node, "Trainer(config): a Trainer takes the run, Trainer(build_run(config, name=...))")
        if name in ("importlib.import_module", "import_module", "__import__") and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                if problem := module_problem(arg.value):
                    self.report(node, problem)
        if name in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2:
            arg = node.args[1]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and private(arg.value):
                self.report(node, f"{name}(..., {arg.value!r}): a private attribute")
        self.generic_visit(node)

    @staticmethod
    def old_trainer_call(node: ast.Call) -> bool:
        """``Trainer(load_config(...))`` or ``Trainer(cfg, name=...)``: the Trainer of a config."""
        first = node.args[0] if node.args else None
        built_from_config = isinstance(first, ast.Call) and ast.unparse(first.func).endswith("load_config")
        return built_from_config or len(node.args) > 1 or any(k.arg == "name" for k in node.keywords)

    def visit_ClassDef(self, node):
        self.scopes.append(node.name)
        self.generic_visit(node)
        self.scopes.pop()

    def visit_FunctionDef(self, node):
        self.scopes.append(node.name)
        for arg in node.args.args + node.args.kwonlyargs:  # a function handed a trainer (run_steps)
            if arg.arg == "trainer":
                self.trainers.add(self.scoped(arg.arg))
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def scoped(self, target: str) -> tuple[str, str]:
        """``target`` with where it lives: ``self.x`` in its class, a name in its function (or the
        module's): two classes' ``self.trainer`` are two things."""
        if target.startswith("self."):
            classes = [s for s in self.scopes if s[:1].isupper()]
            return (classes[-1] if classes else "", target)
        return (self.scopes[-1] if self.scopes else "", target)

    def visit_Assign(self, node):
        """A Trainer: built here (``Trainer(run)``) or by a helper (``common.build_trainer``)."""
        if isinstance(node.value, ast.Call):
            called = ast.unparse(node.value.func).split(".")[-1]
            if called == "Trainer" or called.endswith("_trainer"):
                for target in node.targets:
                    self.trainers.add(self.scoped(ast.unparse(target)))
        self.generic_visit(node)

    def visit_Name(self, node):
        if node.id in REMOVED - {"setup"}:
            self.report(node, f"uses {node.id}: the old Trainer's")

    def visit_Attribute(self, node):
        base = ast.unparse(node.value)
        if node.attr in REMOVED - {"setup"}:
            self.report(node, f"uses .{node.attr}: the old Trainer's")
        elif private(node.attr) and base not in ("self", "cls") and not self.foreign_module(node.value):
            self.report(node, f"touches a private attribute {base}.{node.attr}")
        elif self.used_trainer(base) and node.attr not in TRAINER:
            self.report(node, f"{base}.{node.attr}: not among the loop's public methods (the run's parts: {base}.run)")
        elif problem := self.chain_problem(node):
            self.report(node, problem)
        self.generic_visit(node)

    def chain_problem(self, node: ast.Attribute) -> str | None:
        """Why a dotted name that starts at a hybridrl module (``hybridrl.run.build_run``) leaves the
        surface, or None: each step a module of the surface, the last a name of it."""
        chain = []
        value = node
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if not isinstance(value, ast.Name) or value.id not in self.modules:
            return None
        module = self.modules[value.id]
        for attr in reversed(chain):
            if problem := name_problem(module, attr):
                return problem
            if f"{module}.{attr}" not in ALLOWED:
                return None
            module = f"{module}.{attr}"
        return None

    def used_trainer(self, base: str) -> bool:
        """Whether ``base`` names a Trainer here, or in a function this one is nested in (a closure)."""
        if base.startswith("self."):
            return self.scoped(base) in self.trainers
        return any((scope, base) in self.trainers for scope in ["", *self.scopes])

    def foreign_module(self, value) -> bool:
        """Whether ``value`` (an attribute chain) starts at a module of another package (os._exit)."""
        while isinstance(value, ast.Attribute):
            value = value.value
        return isinstance(value, ast.Name) and value.id in self.imported and value.id not in self.modules

    def check(self, tree: ast.Module) -> list[tuple[int, str]]:
        self.imported = {
            (alias.asname or alias.name).split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        }
        self.visit(tree)
        return sorted(set(self.problems))


def problems(source: str) -> list[tuple[int, str]]:
    return Checker().check(ast.parse(source))


def test_there_are_scripts():
    assert len(SCRIPTS) > 10


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT / "benchmarks")))
def test_script_uses_the_public_surface(path):
    found = problems(path.read_text())
    assert not found, f"{path.relative_to(ROOT)}:\n" + "\n".join(f"  line {n}: {text}" for n, text in found)


@pytest.mark.parametrize(
    "source",
    [
        "from hybridrl.passes import response_logprobs",
        "import hybridrl.forward",
        "from hybridrl import models",
        "from hybridrl.builtin.rollout_hf import HFEngine",
        "from hybridrl.batch import pad_responses",
        "from hybridrl.run import load_causal_lm",
        "from hybridrl import batch\nbatch.pad_responses",
        "from hybridrl import plugins\nplugins._pm",
        "import importlib\nimportlib.import_module('hybridrl.metrics')",
        "trainer.setup()",
        "trainer.evaluate_only(3)",
        "engine._step = step",
        "sorted(e._loops)",
        "getattr(engine, '_uncapturable')",
        "t = Trainer(run)\nt.policy",
        "self.trainer = Trainer(run)\nself.trainer.loggers",
        "from hybridrl_rollout_vllm._private import x",
        "import hybridrl\nhybridrl.passes.Runner",
        "import hybridrl.run\nhybridrl.run.load_causal_lm",
        "Trainer(load_config(data=cfg))",
        "Trainer(cfg, name='bench')",
        "def f(trainer):\n    trainer.engine.close()",
    ],
)
def test_the_check_catches(source):
    assert problems(source), source


@pytest.mark.parametrize(
    "source",
    [
        "from hybridrl.run import build_run\nfrom hybridrl.trainer import Trainer\n"
        "t = Trainer(build_run(cfg))\nt.step(1)\nt.run.policy\nt.close()",
        "from hybridrl import plugins\nplugins.lookup('rollout engine', 'hf')",
        "from hybridrl.components import RunContext, SamplingParams",
        "from hybridrl_testing import build_tiny_model",
        "from hybridrl_rollout_vllm.local import choose_weight_sync",
        "import os\nos._exit(0)",
        "import torch\ntorch._dynamo.reset()",
        "class A:\n    def f(self):\n        self._x = 1",
        "import hybridrl.run\nhybridrl.run.build_run(cfg)",
        "class TRL:\n    def __init__(self):\n        self.trainer = GRPOTrainer()\n        self.trainer.args",
    ],
)
def test_the_check_lets_through(source):
    assert not problems(source), problems(source)
