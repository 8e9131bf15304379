"""hybridrl-agents: train agents you already have.

- the ``harness`` environment (:mod:`hybridrl_agents.harness`) runs an unmodified agent (a command
  or a Python callable written against the OpenAI API) per task, its calls answered by the agent
  gateway (:mod:`hybridrl_agents.gateway`), an OpenAI-compatible endpoint over the run's engine
  that records every call's exact ids, logprobs and policy version into token-exact episodes
  (:mod:`hybridrl_agents.episodes`), kept crash-safe (:mod:`hybridrl_agents.store`);
- the ``posted`` reward: the reward a harness posted for its episode;
- the ``retry`` environment (:mod:`hybridrl_agents.retry`): feedback on a wrong answer and another try.

docs/agents_you_have.md has the whole story.
"""

from __future__ import annotations

from hybridrl.components import RewardFunction
from hybridrl.hookspecs import hookimpl


class PostedReward(RewardFunction):
    """The reward posted to the gateway for each episode (``POST .../episodes/ID/reward``;
    ``HYBRIDRL_REWARD_URL`` tells a harness where); 0 for an episode without one
    (``agent/reward_posted_mean`` is the share that had one)."""

    def score(self, batch):
        if "episode" not in batch:
            raise ValueError(
                "reward function 'posted' reads the rewards harnesses post: use rollout.agent.environment: harness"
            )
        return [float(e["reward"]) if e.get("reward") is not None else 0.0 for e in batch["episode"]]


@hookimpl
def register_environments(register):
    from hybridrl_agents.harness import HarnessEnvironment
    from hybridrl_agents.retry import RetryEnvironment

    register("harness", HarnessEnvironment)
    register("retry", RetryEnvironment)


@hookimpl
def register_reward_functions(register):
    register("posted", PostedReward)
