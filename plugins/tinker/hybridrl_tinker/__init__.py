"""``hybridrl tinker CONFIG``: the Tinker training API (Thinking Machines' ``tinker`` SDK) served
over a local model, every client a LoRA adapter over one frozen base.

A first-party plugin (the ``hybridrl-tinker`` distribution, entry point ``tinker``; docs/tinker.md).
It registers the ``tinker`` command and the run config's ``tinker`` section
(:class:`~hybridrl_tinker.options.TinkerOptions`), and builds on the core's
:class:`~hybridrl.run.Run` (a training run without data: the policy, the engine session). One
module per job, imported when the command runs:

- :mod:`~hybridrl_tinker.losses`: the built-in losses of ``forward_backward``, on one datum.
- :mod:`~hybridrl_tinker.wire`: the protobuf messages (``forward_backward``'s request, its result
  and a sample's), read and written without a protobuf library.
- :mod:`~hybridrl_tinker.adapters`: every client's LoRA factors and AdamW state over the policy's
  one set of LoRA layers; checkpoints as peft adapter folders.
- :mod:`~hybridrl_tinker.futures`: the futures and the one worker that runs every call in order.
- :mod:`~hybridrl_tinker.service`: what each call does.
- :mod:`~hybridrl_tinker.server`: the HTTP paths; :mod:`~hybridrl_tinker.command`: the command.
"""

from __future__ import annotations

from hybridrl.hookspecs import hookimpl

__version__ = "0.1.0"


@hookimpl
def register_commands(subparsers):
    from hybridrl_tinker.command import add_command

    add_command(subparsers)


@hookimpl
def register_config_sections(register):
    from hybridrl_tinker.options import TinkerOptions

    register("tinker", TinkerOptions)
