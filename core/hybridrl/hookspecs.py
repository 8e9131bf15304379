"""Every hook of hybridrl, documented. This file is the contract between the core and plugins.

A plugin is a module (or object) with functions marked ``@hookimpl`` whose names are the
hooks below. It is found through the ``hybridrl`` entry-point group of an installed package,
or registered in code with ``hybridrl.plugins.get_plugin_manager().register(obj)``.

Two kinds of hooks:

* **Registration hooks** (``register_*``) are called once per process, when the registry
  is first built. Each receives a ``register(name, cls)`` callback; the plugin calls it once
  per component it provides. ``cls`` is a subclass of the matching base class in
  :mod:`hybridrl.components` and carries its options as a pydantic model in ``cls.Options``.
  Names are unique across all plugins.
* **Lifecycle hooks** (``on_*``) are called by the trainer at named points of the run. Every
  plugin implementing one runs; return values are ignored.

Hooks are always called with keyword arguments, so an implementation may accept only the
arguments it uses (pluggy passes the ones it names).
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("hybridrl")
hookimpl = pluggy.HookimplMarker("hybridrl")


@hookspec
def register_rollout_engines(register):
    """Register rollout engines: ``register("vllm", VLLMEngine)``.

    :param register: callback ``register(name: str, cls: type[RolloutEngine])``.

    The class is instantiated as ``cls(options, ctx)`` with its validated ``Options`` and the
    :class:`~hybridrl.components.RunContext`. It is named in YAML as ``rollout.engine``.
    """


@hookspec
def register_reward_functions(register):
    """Register reward functions: ``register("reranker", RerankerReward)``.

    :param register: callback ``register(name: str, cls: type[RewardFunction])``.

    Named in YAML as ``rewards[i].function``; several rewards are combined with weights.
    """


@hookspec
def register_algorithms(register):
    """Register RL algorithms: ``register("grpo", GRPO)``.

    :param register: callback ``register(name: str, cls: type[Algorithm])``.

    Named in YAML as ``algorithm.name``. The algorithm supplies advantages and the loss;
    the trainer never branches on its name.
    """


@hookspec
def register_sharding_strategies(register):
    """Register sharding strategies: ``register("fsdp", FSDPStrategy)``.

    :param register: callback ``register(name: str, cls: type[ShardingStrategy])``.

    Named in YAML as ``sharding.strategy``.
    """


@hookspec
def register_loggers(register):
    """Register metric loggers (trackers): ``register("wandb", WandbLogger)``.

    :param register: callback ``register(name: str, cls: type[Logger])``.

    Named in YAML in the list ``logging.loggers``; a logger's options are the mapping
    ``logging.<name>``.
    """


@hookspec
def register_datasets(register):
    """Register prompt sources: ``register("reasoning_gym", ReasoningGymSource)``.

    :param register: callback ``register(name: str, cls: type[PromptSource])``.

    Named in YAML as ``data.source``.
    """


@hookspec
def register_environments(register):
    """Register environments for multi-turn rollouts: ``register("tools", ToolEnvironment)``.

    :param register: callback ``register(name: str, cls: type[Environment])``.

    Named in YAML as ``rollout.agent.environment``. An environment receives each sampled
    assistant turn and answers with an :class:`~hybridrl.components.Observation` (messages to
    append, a done flag, an optional reward); the agent loop of the core turns observations into
    tokens and trains only on the sampled ones.
    """


@hookspec
def register_tools(register):
    """Register tools an environment can call: ``register("calculator", Calculator)``.

    :param register: callback ``register(name: str, cls: type[Tool])``.

    Named in YAML in the list ``rollout.agent.tools``; the chat template shows the model their
    ``schema()``.
    """


@hookspec
def register_tool_parsers(register):
    """Register parsers of tool calls in a sampled turn: ``register("hermes", HermesParser)``.

    :param register: callback ``register(name: str, cls: type[ToolParser])``.

    Named in YAML as ``rollout.agent.parser``; the default ``hermes`` reads the Qwen/Hermes
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.
    """


@hookspec
def register_commands(subparsers):
    """Add subcommands to the ``hybridrl`` command line.

    :param subparsers: the ``argparse`` sub-parsers object of ``hybridrl``. Add a parser
        with ``subparsers.add_parser(name, help=...)`` and give it
        ``set_defaults(func=callable)``; the callable receives the parsed arguments and returns
        an exit code (or None for 0).
    """


@hookspec
def on_train_start(run, start_step):
    """Called once after every part of the run is built, before the first step.

    :param run: the :class:`~hybridrl.run.Run`, read-only: ``run.config`` is the run config,
        ``run.run_dir`` the run directory, ``run.policy``, ``run.session``, ``run.rewards`` its parts.
    :param start_step: the step the run continues after (0 for a new run; a resume's checkpoint step).
    """


@hookspec
def on_step_end(run, step, metrics, batch):
    """Called after every step, after the weight sync and before the loggers write. Under
    ``hybridrl serve`` a step is an update on users' ratings (its batch: the rated answers).

    :param run: the :class:`~hybridrl.run.Run`, read-only.
    :param step: the step just finished, counting from 1.
    :param metrics: ``dict[str, float]`` of this step; a plugin may add entries, and they
        are logged like the trainer's own.
    :param batch: the :class:`~hybridrl.batch.Batch` of this step (token ids, masks,
        rewards, advantages, decoded texts). Read-only by convention.
    """


@hookspec
def on_checkpoint(run, step, path):
    """Called after a checkpoint has been written completely.

    :param run: the :class:`~hybridrl.run.Run`, read-only.
    :param step: the step the checkpoint holds.
    :param path: ``pathlib.Path`` of the finished checkpoint directory. Read it, copy it; do not
        write into it: its ``meta.json`` lists every file, and a resume refuses a checkpoint with
        files it does not list (state a plugin keeps goes through ``state_dict``).
    """


@hookspec
def on_train_end(run, metrics):
    """Called once when the run ends, normally or not (``hybridrl serve``: when it stops).

    :param run: the :class:`~hybridrl.run.Run`, read-only.
    :param metrics: the last step's metrics (empty if no step finished).
    """


@hookspec
def register_config_sections(register):
    """Register top-level sections of the run config that a plugin owns: ``register("online", OnlineOptions)``.

    :param register: callback ``register(name: str, options: type[pydantic.BaseModel])``.

    The YAML's key ``name`` is validated against ``options`` (unknown keys are errors naming the
    section and the plugin), overrides reach it (``name.key=value``), ``config.section(name)``
    gives the validated model (its defaults when the YAML leaves the section out), and the run's
    config.yaml writes it out. A name is refused when it is a core section (``trainer``...) or
    another plugin's.
    """
