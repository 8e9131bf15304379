"""``hybridrl tenants CONFIG``: several LoRA adapters (tenants) trained in one run over one frozen base,
each with its own data, rewards, optimizer, checkpoints and record.

A first-party plugin (the ``hybridrl-tenants`` distribution, entry point ``tenants``; docs/tenants.md).
It registers the command and the run config's ``tenants`` section
(:class:`~hybridrl_tenants.options.TenantsOptions`), and builds on the core's
:class:`~hybridrl.run.Run` (one policy, one engine) and :class:`~hybridrl.trainer.Trainer` (a step
of each tenant's own, over a view of the run):

- :mod:`~hybridrl_tenants.options`: the section;
- :mod:`~hybridrl_tenants.configs`: each tenant's run config, checked before any model loads;
- :mod:`~hybridrl_tenants.loop`: the tenants' steps in turn, their checkpoints and resume;
- :mod:`~hybridrl_tenants.command`: the command.
"""

from __future__ import annotations

from hybridrl.errors import ConfigError
from hybridrl.hookspecs import hookimpl

__version__ = "0.1.0"


@hookimpl
def register_commands(subparsers):
    from hybridrl_tenants.command import add_command

    add_command(subparsers)


@hookimpl
def register_config_sections(register):
    from hybridrl_tenants.options import TenantsOptions

    register("tenants", TenantsOptions)


@hookimpl
def on_train_start(run, start_step):
    """A config with tenants trains them with ``hybridrl tenants``, not as one adapter."""
    names = list(run.config.section("tenants").root)
    if names:
        raise ConfigError(
            f"this config trains the tenants {', '.join(names)}: run it with 'hybridrl tenants CONFIG' "
            "(docs/tenants.md), or remove the tenants section to train one adapter."
        )
