"""The plugin manager: built-in plugins plus the ``hybridrl`` entry-point group, loaded once.

Set ``HYBRIDRL_LOAD_PLUGINS`` to a comma-separated list of entry-point names to load only
those (an empty value loads none); built-ins always load.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass, field
from importlib.metadata import entry_points

import pluggy
from pydantic import BaseModel

from hybridrl import components, hookspecs
from hybridrl.errors import did_you_mean, stage_errors

ENTRY_POINT_GROUP = "hybridrl"
BUILTIN_PLUGINS = (
    "hybridrl.builtin.rollout_hf",
    "hybridrl.builtin.rewards",
    "hybridrl.builtin.sharding_single",
    "hybridrl.builtin.sharding_fsdp",
    "hybridrl.builtin.datasets",
    "hybridrl.builtin.loggers",
    "hybridrl.builtin.environments",
)


@dataclass(frozen=True)
class Kind:
    """A kind of component: how plugins register it and where the YAML names it."""

    hook: str  # the registration hook
    base: type  # the base class in hybridrl.components
    section: str  # the YAML section ("rollout.agent": a section inside a section)
    key: str  # the key of the section that names the plugin
    many: bool = False  # the section is a list of components (rewards) or the key lists names (loggers)
    own_section: bool = True  # the plugin's options are the section's other keys (not for loggers, tools)

    @property
    def yaml_key(self) -> str:
        return (
            f"{self.section}[].{self.key}" if self.many and self.section == "rewards" else f"{self.section}.{self.key}"
        )


# The one table of component kinds: registration, config sections and messages all read it.
KINDS = {
    "rollout engine": Kind("register_rollout_engines", components.RolloutEngine, "rollout", "engine"),
    "algorithm": Kind("register_algorithms", components.Algorithm, "algorithm", "name"),
    "sharding strategy": Kind("register_sharding_strategies", components.ShardingStrategy, "sharding", "strategy"),
    "dataset": Kind("register_datasets", components.PromptSource, "data", "source"),
    "reward function": Kind("register_reward_functions", components.RewardFunction, "rewards", "function", True),
    "logger": Kind("register_loggers", components.Logger, "logging", "loggers", True, own_section=False),
    "environment": Kind("register_environments", components.Environment, "rollout.agent", "environment"),
    "tool": Kind("register_tools", components.Tool, "rollout.agent", "tools", True, own_section=False),
    "tool parser": Kind("register_tool_parsers", components.ToolParser, "rollout.agent", "parser", own_section=False),
}


#: registration hooks that register no component, and what ``hybridrl plugins`` calls what they register
REGISTERS = {"register_commands": "command", "register_config_sections": "config section"}


#: names the first-party plugins register, and their distributions (make test installs them all)
FIRST_PARTY = {
    "vllm": "hybridrl-rollout-vllm",
    "sglang": "hybridrl-rollout-sglang",
    "grpo": "hybridrl-algo-grpo",
    "ppo": "hybridrl-algo-ppo",
    "python": "hybridrl-reward-python",
    "reward_model": "hybridrl-reward-hf",
    "reranker": "hybridrl-reward-hf",
    "embedding_similarity": "hybridrl-reward-hf",
    "user_rating": "hybridrl-serve",
    "harness": "hybridrl-agents",
    "posted": "hybridrl-agents",
    "retry": "hybridrl-agents",
    "openenv": "hybridrl-env-openenv",
    "verifiers": "hybridrl-env-verifiers",
    "wandb": "hybridrl-trackers",
    "tensorboard": "hybridrl-trackers",
}
# the first-party plugins' commands: where one is missing, hybridrl COMMAND says which to install
FIRST_PARTY_COMMANDS = {
    "serve": "hybridrl-serve",
    "import": "hybridrl-migrate",
    "dashboard": "hybridrl-dashboard",
    "export": "hybridrl-export",
    "tinker": "hybridrl-tinker",
    "tenants": "hybridrl-tenants",
    "serve-reward": "hybridrl-reward-hf",
}


def install_hint(name: str, home: str) -> str:
    return f"'{name}' comes with {home}: pip install -e plugins/{home[9:].replace('-', '_')}."


class PluginError(Exception):
    """A plugin is missing, duplicated or malformed; the message says which and what to do."""


@dataclass
class PluginInfo:
    name: str
    package: str  # the distribution that provides it ("hybridrl" for built-ins)
    version: str
    registered: dict[str, list[str]] = field(default_factory=dict)  # kind -> names
    hooks: list[str] = field(default_factory=list)  # the lifecycle and other non-registration hooks it implements


@dataclass
class Registered:
    cls: type
    plugin: str
    package: str


SECTION = "config section"  # the registry's kind of the top-level config sections plugins own (not a component)
_pm: pluggy.PluginManager | None = None
_registry: dict[str, dict[str, Registered]] | None = None
_infos: dict[str, PluginInfo] = {}


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, loading plugins on first use."""
    global _pm
    if _pm is None:
        pm = pluggy.PluginManager("hybridrl")
        pm.add_hookspecs(hookspecs)
        from hybridrl import __version__

        for module_name in BUILTIN_PLUGINS:
            module = importlib.import_module(module_name)
            pm.register(module, name=module_name)
            _infos[module_name] = PluginInfo(module_name, "hybridrl", __version__)
        _load_entry_points(pm)
        pm.check_pending()  # a misspelled hook name fails here, loudly
        _pm = pm
    return _pm


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    allow = os.environ.get("HYBRIDRL_LOAD_PLUGINS")
    allowed = None if allow is None else {n.strip() for n in allow.split(",") if n.strip()}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if allowed is not None and ep.name not in allowed:
            continue
        if pm.has_plugin(ep.name):
            continue
        dist = ep.dist.name if ep.dist else "?"
        try:
            module = ep.load()
        except Exception as e:
            raise PluginError(
                f"Plugin '{ep.name}' from package '{dist}' failed to import: {e!r}. "
                f"Fix or uninstall it (pip uninstall {dist}), or set HYBRIDRL_LOAD_PLUGINS "
                "to the plugins you want."
            ) from e
        pm.register(module, name=ep.name)
        _infos[ep.name] = PluginInfo(ep.name, dist, ep.dist.version if ep.dist else "?")


def registry() -> dict[str, dict[str, Registered]]:
    """kind -> name -> Registered, built once by calling every registration hook; the kind
    ``config section`` holds the top-level config sections plugins own (their options models)."""
    global _registry
    if _registry is None:
        pm = get_plugin_manager()
        reg: dict[str, dict[str, Registered]] = {kind: {} for kind in [*KINDS, SECTION]}
        for info in _infos.values():
            info.registered.clear()
        hooks = [(kind, k.hook, k.base, "hybridrl.components") for kind, k in KINDS.items()]
        for kind, hook, base, home in [*hooks, (SECTION, "register_config_sections", BaseModel, "pydantic")]:
            for impl in getattr(pm.hook, hook).get_hookimpls():
                info = _infos.get(impl.plugin_name) or PluginInfo(impl.plugin_name, "(in code)", "")
                _infos.setdefault(impl.plugin_name, info)
                impl.function(register=_registrar(kind, base, reg[kind], info, home))
        registration = {k.hook for k in KINDS.values()} | set(REGISTERS)
        for info in _infos.values():
            info.hooks = []
        for name, caller in vars(pm.hook).items():
            if name in registration or not hasattr(caller, "get_hookimpls"):
                continue
            for impl in caller.get_hookimpls():
                if impl.plugin_name in _infos:
                    _infos[impl.plugin_name].hooks.append(name)
        for impl in pm.hook.register_commands.get_hookimpls():  # for 'hybridrl plugins' to list
            subparsers = argparse.ArgumentParser(add_help=False).add_subparsers()
            impl.function(subparsers=subparsers)
            if subparsers.choices and impl.plugin_name in _infos:
                _infos[impl.plugin_name].registered["command"] = list(subparsers.choices)
        _registry = reg
    return _registry


def _registrar(kind, base, table, info, home="hybridrl.components"):
    def register(name: str, cls: type) -> None:
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise PluginError(
                f"Plugin '{info.name}' registered {kind} '{name}' as {cls!r}, "
                f"which is not a subclass of {home}.{base.__name__}."
            )
        if name in table:
            other = table[name]
            raise PluginError(
                f"Two plugins register the {kind} '{name}': '{other.plugin}' (package "
                f"'{other.package}') and '{info.name}' (package '{info.package}'). "
                "Uninstall one, or limit loading with HYBRIDRL_LOAD_PLUGINS."
            )
        table[name] = Registered(cls, info.name, info.package)
        info.registered.setdefault(kind, []).append(name)

    return register


def lookup(kind: str, name: str) -> type:
    """The class registered as ``name`` for ``kind``, or an error listing the choices."""
    table = registry()[kind]
    if name not in table:
        key = KINDS[kind].yaml_key
        choices = ", ".join(sorted(table)) or "(none installed)"
        home = FIRST_PARTY.get(name)
        install = f" {install_hint(name, home)}" if home else ""
        raise PluginError(
            f"Unknown {kind} '{name}' ({key}).{did_you_mean(name, table)} Available: {choices}.{install} "
            "Run 'hybridrl plugins' to see installed plugins."
        )
    return table[name].cls


def config_sections() -> dict[str, Registered]:
    """The top-level config sections plugins registered: name -> Registered (``cls``: the options model)."""
    return registry()[SECTION]


def build(kind: str, name: str, options, ctx: components.RunContext):
    """The ``kind`` plugin ``name`` built as ``cls(options, ctx)``; what fails in its constructor is a
    :class:`~hybridrl.errors.StageError` naming it (``dataset 'hf' failed in setup: ...``)."""
    cls = lookup(kind, name)
    with stage_errors(f"{kind} '{name}'", "setup"):
        return cls(options, ctx)


def hook_names() -> list[str]:
    """Every hook of :mod:`hybridrl.hookspecs`."""
    return [name for name, caller in vars(get_plugin_manager().hook).items() if hasattr(caller, "get_hookimpls")]


def plugin_infos() -> list[PluginInfo]:
    registry()
    return list(_infos.values())


def reset() -> None:
    """Forget the loaded plugins and registry (tests; after registering a plugin in code)."""
    global _pm, _registry
    _pm, _registry = None, None
    _infos.clear()


def invalidate_registry() -> None:
    """Rebuild the registry on next use, keeping the plugin manager (after pm.register)."""
    global _registry
    _registry = None


def load_object(spec: str):
    """The object ``spec`` names: ``module:name`` (an importable module) or ``file.py:name`` (a file,
    relative to the working folder): how configs name a user's callable or class."""
    import importlib.util
    from pathlib import Path

    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"'{spec}' must be 'module:name' or 'file.py:name'")
    if where.endswith(".py"):
        path = Path(where).expanduser().resolve()
        module_spec = importlib.util.spec_from_file_location(f"hybridrl_user_{path.stem}", path)
        module = sys.modules[module_spec.name] = importlib.util.module_from_spec(module_spec)  # as imports do
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    if not hasattr(module, name):
        raise ValueError(f"'{where}' has no '{name}'")
    return getattr(module, name)
