"""hybridrl-env-openenv: OpenEnv (``openenv-core``) environments, run in this process.

- the ``openenv`` environment (``rollout.agent.environment``): an instance of an OpenEnv
  Environment class per trajectory, stepped with each sampled turn; an MCP environment's tools are
  shown to the model and its calls made (:mod:`hybridrl_env_openenv.environment`);
- the ``openenv`` prompt source (``data.source``): a row per seed, its prompt the first observation.

docs/agents_you_have.md ("Environments from the hubs") has the whole story.
"""

from __future__ import annotations

from hybridrl.hookspecs import hookimpl


@hookimpl
def register_environments(register):
    from hybridrl_env_openenv.environment import OpenEnvEnvironment

    register("openenv", OpenEnvEnvironment)


@hookimpl
def register_datasets(register):
    from hybridrl_env_openenv.environment import OpenEnvSource

    register("openenv", OpenEnvSource)
