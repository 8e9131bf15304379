"""docs/plugins.md documents each hook with the signature the plugin manager calls it with, and an
example whose implementation takes only arguments the hook passes (pluggy calls an implementation
with the subset of arguments it names; a name the hook does not pass fails at registration)."""

import ast
import inspect
import re
from pathlib import Path

import pytest

from hybridrl import hookspecs

DOC = (Path(__file__).resolve().parents[1] / "docs" / "plugins.md").read_text()
HOOKS = sorted(n for n, f in vars(hookspecs).items() if n.startswith(("register_", "on_")) and callable(f))


def section(name: str) -> tuple[str, str]:
    """The documented signature's arguments and the section's text."""
    found = re.search(rf"^### `{name}\((.*?)\)`(.*?)(?=^### |\Z)", DOC, re.M | re.S)
    assert found, f"docs/plugins.md has no section '### `{name}(...)`'"
    return found.group(1), found.group(2)


@pytest.mark.parametrize("name", HOOKS)
def test_the_documented_signature_is_the_hooks(name):
    documented, _ = section(name)
    spec = list(inspect.signature(getattr(hookspecs, name)).parameters)
    assert [a.strip() for a in documented.split(",") if a.strip()] == spec, f"{name}: the docs say ({documented})"


@pytest.mark.parametrize("name", HOOKS)
def test_the_example_takes_what_the_hook_passes(name):
    _, text = section(name)
    spec = set(inspect.signature(getattr(hookspecs, name)).parameters)
    examples = re.findall(r"```python\n(.*?)```", text, re.S)
    impls = [
        node
        for code in examples
        for node in ast.walk(ast.parse(code))
        if isinstance(node, ast.FunctionDef) and node.name == name
    ]
    assert impls, f"the section of {name} has no example implementing it"
    for impl in impls:
        args = {a.arg for a in impl.args.args} - {"self"}
        assert args <= spec, f"{name}'s example takes {sorted(args - spec)}, which the hook does not pass"
