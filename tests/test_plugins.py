"""Plugin discovery through real entry points, the allow-list, duplicates, and hook docs."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl import hookspecs, plugins
from hybridrl.components import RolloutEngine
from hybridrl.hookspecs import hookimpl

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "hybridrl.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def test_installed_plugin_is_found_through_its_entry_point():
    out = run_cli("plugins", "--json")
    assert out.returncode == 0, out.stderr
    infos = {i["name"]: i for i in json.loads(out.stdout)}
    assert infos["grpo"]["package"] == "hybridrl-algo-grpo"
    assert infos["grpo"]["registered"] == {"algorithm": ["grpo"]}
    assert infos["hybridrl.builtin.rollout_hf"]["registered"] == {"rollout engine": ["hf"]}
    # the faces are first-party plugins, found through their entry points like any third party's
    assert infos["dashboard"]["package"] == "hybridrl-dashboard"
    assert infos["dashboard"]["registered"] == {"command": ["dashboard"]}
    assert infos["migrate"]["registered"] == {"command": ["import"]}
    assert infos["export"]["package"] == "hybridrl-export"
    assert infos["export"]["registered"] == {"command": ["export"]}
    assert infos["reward_python"]["registered"] == {"reward function": ["python"], "tool": ["calculator", "python"]}
    assert infos["reward_hf"]["registered"]["command"] == ["serve-reward"]
    assert infos["serve"]["package"] == "hybridrl-serve"
    assert infos["serve"]["registered"] == {
        "reward function": ["user_rating"],
        "config section": ["online"],
        "command": ["serve"],
    }
    out = run_cli("plugins", "--hook", "register_config_sections")
    assert out.returncode == 0 and out.stdout.startswith("serve (hybridrl-serve "), out.stdout + out.stderr


def test_each_first_party_name_an_error_points_to_is_registered_by_that_distribution(monkeypatch):
    """A name a first-party plugin registers, where that plugin is not installed, says which to install
    (plugins.FIRST_PARTY): each such name is registered by the distribution it names (make test installs all)."""
    registered = {(name, entry.package) for table in plugins.registry().values() for name, entry in table.items()}
    assert {(name, home) for name, home in plugins.FIRST_PARTY.items()} <= registered
    monkeypatch.delitem(plugins.registry()["environment"], "retry")  # as where hybridrl-agents is not installed
    with pytest.raises(plugins.PluginError, match="'retry' comes with hybridrl-agents: pip install -e plugins/agents"):
        plugins.lookup("environment", "retry")


def test_a_first_party_command_without_its_plugin_says_which_to_install():
    """Each command of plugins.FIRST_PARTY_COMMANDS is registered by the distribution it names (make test installs
    all); where that plugin is not loaded, the command says which to install, not argparse's 'invalid choice'."""
    infos = json.loads(run_cli("plugins", "--json").stdout)
    registered = {(c, i["package"]) for i in infos for c in i.get("registered", {}).get("command", [])}
    assert set(plugins.FIRST_PARTY_COMMANDS.items()) <= registered
    alone = {"HYBRIDRL_LOAD_PLUGINS": ""}  # no entry-point plugin loads: the core alone
    out = run_cli("export", "step-000010", "out", env=alone)
    assert out.returncode == 2 and "'export' comes with hybridrl-export: pip install -e plugins/export" in out.stderr
    out = run_cli("serve-reward", "cfg.yaml", env=alone)
    assert "pip install -e plugins/reward_hf" in out.stderr, out.stderr
    out = run_cli("exprot", env=alone)  # no command of any plugin: argparse lists the choices
    assert out.returncode == 2 and "invalid choice: 'exprot'" in out.stderr and "comes with" not in out.stderr


def test_plugins_text_output_names_versions():
    out = run_cli("plugins")
    assert re.search(r"^grpo \(hybridrl-algo-grpo \d+\.\d+\.\d+\) - algorithm: grpo$", out.stdout, re.M), out.stdout


def test_allow_list_limits_entry_point_plugins():
    out = run_cli("plugins", "--json", env={"HYBRIDRL_LOAD_PLUGINS": ""})
    names = {i["name"] for i in json.loads(out.stdout)}
    assert "grpo" not in names
    assert "hybridrl.builtin.rewards" in names  # built-ins always load


class OtherHF:
    class Engine(RolloutEngine):
        pass

    @hookimpl
    def register_rollout_engines(self, register):
        register("hf", self.Engine)


def test_duplicate_name_is_an_error_naming_both(register_plugin):
    register_plugin(OtherHF(), name="my-plugin")
    with pytest.raises(plugins.PluginError) as e:
        plugins.registry()
    msg = str(e.value)
    assert "Two plugins register the rollout engine 'hf'" in msg
    assert "'hybridrl.builtin.rollout_hf' (package 'hybridrl')" in msg and "'my-plugin'" in msg


def test_a_config_section_registered_twice_is_an_error_naming_both(register_plugin):
    from pydantic import BaseModel

    class Section:
        @hookimpl
        def register_config_sections(self, register):
            register("report", BaseModel)

    register_plugin(Section(), name="first-plugin")
    register_plugin(Section(), name="second-plugin")
    with pytest.raises(plugins.PluginError) as e:
        plugins.registry()
    msg = str(e.value)
    assert "Two plugins register the config section 'report'" in msg
    assert "'first-plugin'" in msg and "'second-plugin'" in msg


def test_registering_a_non_component_is_an_error(register_plugin):
    class Bad:
        @hookimpl
        def register_algorithms(self, register):
            register("bad", dict)

    register_plugin(Bad(), name="bad-plugin")
    with pytest.raises(plugins.PluginError, match="not a subclass of hybridrl.components.Algorithm"):
        plugins.registry()


def test_in_code_plugin_is_usable(register_plugin):
    class Mine:
        class Engine(RolloutEngine):
            pass

        @hookimpl
        def register_rollout_engines(self, register):
            register("mine", self.Engine)

    register_plugin(Mine(), name="mine")
    assert plugins.lookup("rollout engine", "mine") is Mine.Engine


def test_misspelled_hook_fails_loudly():
    import pluggy

    pm = pluggy.PluginManager("hybridrl")
    pm.add_hookspecs(hookspecs)

    class Typo:
        @hookimpl
        def register_rollout_engine(self, register):  # missing "s"
            pass

    pm.register(Typo())
    with pytest.raises(pluggy.PluginValidationError, match="register_rollout_engine"):
        pm.check_pending()


def test_every_hook_is_documented_with_an_example():
    doc = (ROOT / "docs" / "plugins.md").read_text()
    hooks = [n for n in dir(hookspecs) if n.startswith(("register_", "on_"))]
    assert len(hooks) == 15
    for name in hooks:
        section = re.search(rf"^### `{name}\(.*?(?=^### |\Z)", doc, re.M | re.S)
        assert section, f"docs/plugins.md has no section for hook {name}"
        assert "```python" in section.group(0), f"the section of {name} has no example"


def test_config_reference_is_current():
    import runpy

    gen = runpy.run_path(str(ROOT / "scripts" / "config_docs.py"), run_name="not_main")["main"]()
    assert gen == (ROOT / "docs" / "config.md").read_text(), "run: python scripts/config_docs.py > docs/config.md"


def test_plugin_adds_a_cli_command(register_plugin, capsys):
    from hybridrl.cli import main

    class Hello:
        @hookimpl
        def register_commands(self, subparsers):
            p = subparsers.add_parser("hello", help="Say hello.")
            p.add_argument("name")
            p.set_defaults(func=lambda args: print(f"hello {args.name}") or 3)

    register_plugin(Hello(), name="hello")
    assert main(["hello", "world"]) == 3
    assert capsys.readouterr().out == "hello world\n"


def test_a_component_failing_without_a_message_is_named_with_where_it_failed():
    """A library's bare ``assert`` has no message: the one line still says what failed and where (vLLM's
    LoRA kernel asserting 16-bit weights read "AssertionError: " and nothing else)."""
    from hybridrl.errors import StageError, stage_errors

    def kernel(weight):  # a bare assert, as a library's compiles (pytest would rewrite an assert here)
        if weight not in ("float16", "bfloat16"):
            raise AssertionError

    with pytest.raises(StageError) as e, stage_errors("rollout engine 'vllm'", "setup"):
        kernel("float32")
    line = str(e.value)
    assert line.startswith("rollout engine 'vllm' failed in setup: AssertionError: (no message) raised at ")
    assert f"test_plugins.py:{kernel.__code__.co_firstlineno + 2} in kernel: raise AssertionError" in line
    with pytest.raises(StageError, match=r"failed in setup: KeyError: 'x'$"), stage_errors("dataset 'hf'", "setup"):
        {}["x"]
