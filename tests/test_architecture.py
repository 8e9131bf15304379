"""The layout of docs/architecture.md, checked: no import cycles in the core, collectives that import
nothing of hybridrl, and plugins that use the modules meant for sharing, never the trainer."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core" / "hybridrl"


def module_name(path: Path) -> str:
    parts = path.relative_to(CORE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(path: Path) -> set[str]:
    """hybridrl modules imported when ``path`` is imported: module level, outside TYPE_CHECKING."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if isinstance(node, ast.If | ast.Try) else [node]:
            if isinstance(sub, ast.Import):
                found |= {a.name for a in sub.names if a.name.startswith("hybridrl")}
            elif isinstance(sub, ast.ImportFrom) and sub.module and sub.module.startswith("hybridrl"):
                found.add(sub.module)
                found |= {f"{sub.module}.{a.name}" for a in sub.names}  # from hybridrl import batch
    return found


def all_imports(path: Path) -> set[str]:
    """hybridrl modules ``path`` names anywhere: module level, under TYPE_CHECKING, inside functions."""
    found = set()
    for sub in ast.walk(ast.parse(path.read_text())):
        if isinstance(sub, ast.Import):
            found |= {a.name for a in sub.names if a.name.startswith("hybridrl")}
        elif isinstance(sub, ast.ImportFrom) and sub.module and sub.module.startswith("hybridrl"):
            found.add(sub.module)
            found |= {f"{sub.module}.{a.name}" for a in sub.names}
    return found


def core_graph(imports=top_level_imports) -> dict[str, set[str]]:
    modules = {module_name(p): p for p in CORE.rglob("*.py")}
    return {name: {m for m in imports(path) if m in modules and m != name} for name, path in modules.items()}


def test_no_import_cycles_in_the_core_at_any_level():
    """Not at import time, and not either through imports for type checking or inside functions:
    every module stands on the modules below it."""
    graph = core_graph(all_imports)
    state: dict[str, str] = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(nxt) :] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_distributed_holds_collectives_only():
    assert core_graph()["hybridrl.distributed"] == set()


# plugins that drive whole runs: they build a Run and use the loop's public methods (testing: the tests' runs)
FACES = {"serve", "tinker", "tenants", "testing"}


def test_components_import_shared_modules_not_the_loop():
    """A component gets what it needs through its RunContext; only a face drives a run."""
    for path in (ROOT / "plugins").glob("*/hybridrl_*/**/*.py"):
        if path.relative_to(ROOT / "plugins").parts[0] in FACES:
            continue
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                imported |= {a.name for a in node.names}
        loop = imported & {"hybridrl.trainer", "hybridrl.run"}
        assert not loop, f"{path} imports {', '.join(sorted(loop))}; a component uses its ctx and shared modules"


def test_the_contract_stands_on_the_ground():
    """components.py (the plugin contract) imports only the data types and helpers it hands to
    plugins, even for type checking: nothing of the trainer's machinery."""
    assert core_graph(all_imports)["hybridrl.components"] <= {
        "hybridrl.batch",
        "hybridrl.context",
        "hybridrl.devices",
        "hybridrl.distributed",
        "hybridrl.functional",
        "hybridrl.options",
        "hybridrl.sampling",
    }


def test_modules_of_a_few_hundred_lines_and_functions_that_fit_on_a_screen():
    """The house's sizes (docs/architecture.md): no module of the core or the plugins above 450 lines, no
    function of the core above 60 (of a plugin, 80). A module that grows past them holds two jobs;
    split it by job."""
    too_long = []
    for path in [*CORE.rglob("*.py"), *(ROOT / "plugins").glob("*/hybridrl_*/**/*.py")]:
        source, longest = path.read_text(), 60 if path.is_relative_to(CORE) else 80
        if len(source.splitlines()) > 450:
            too_long.append(f"{path.relative_to(ROOT)}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= longest:
                too_long.append(f"{path.relative_to(ROOT)}: {node.name} is {node.end_lineno - node.lineno + 1} lines")
    assert not too_long, too_long


CORE_LINES = 12_500  # the loop, the contract, the pass, the session, evaluation; faces are plugins


def test_the_core_stays_the_loop():
    """The core's Python, counted: a capability that grows it past this belongs in a plugin."""
    lines = sum(len(p.read_text().splitlines()) for p in CORE.rglob("*.py"))
    assert lines <= CORE_LINES, f"core/hybridrl holds {lines} lines of Python (at most {CORE_LINES}): move a face out"
