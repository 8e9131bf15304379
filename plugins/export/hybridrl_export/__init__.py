"""``hybridrl export CKPT OUT``: a checkpoint's policy as a plain Hugging Face model folder.

A first-party plugin (the ``hybridrl-export`` distribution, entry point ``export``; docs/distributed.md,
Checkpoints). It registers the ``export`` command and reads a checkpoint only through the core's
checks (:func:`hybridrl.checkpoint_files.verify`). One module per job, imported when the command runs
(``hybridrl --help`` stays fast):

- :mod:`~hybridrl_export.export`: :func:`export`, the policy's files checked as a resume checks them
  and copied (a LoRA checkpoint: the adapter folder, or with ``merged`` the base with it merged in).
- :mod:`~hybridrl_export.command`: the ``export`` command.
"""

from __future__ import annotations

from hybridrl.hookspecs import hookimpl

__version__ = "0.1.0"


@hookimpl
def register_commands(subparsers):
    from hybridrl_export.command import add_command

    add_command(subparsers)
