"""hybridrl-env-verifiers: environments of the verifiers hub (verifiers 0.4), unchanged.

- the ``verifiers`` environment (``rollout.agent.environment``): each episode is run by verifiers
  itself, in an interpreter of its own (:mod:`hybridrl_env_verifiers.runner`), its model calls
  answered and recorded by the agent gateway of hybridrl-agents; the rubric's reward is posted to
  the episode (:mod:`hybridrl_env_verifiers.environment`);
- the ``verifiers`` prompt source (``data.source``): the environment's taskset, one row per task.

docs/agents_you_have.md ("Environments from the hubs") has the whole story.
"""

from __future__ import annotations

from hybridrl.hookspecs import hookimpl


@hookimpl
def register_environments(register):
    from hybridrl_env_verifiers.environment import VerifiersEnvironment

    register("verifiers", VerifiersEnvironment)


@hookimpl
def register_datasets(register):
    from hybridrl_env_verifiers.environment import VerifiersSource

    register("verifiers", VerifiersSource)
