"""Hugging Face models as hybridrl rewards, and reward services over HTTP.

Reward functions: ``reward_model`` (a sequence-classification reward model with its own
chat template), ``reranker`` (a cross-encoder scoring query and response),
``embedding_similarity`` (cosine similarity to a reference with a sentence-transformers
encoder) and ``remote`` (an HTTP reward service). Command: ``hybridrl serve-reward CONFIG``.
"""

from __future__ import annotations

from hybridrl.hookspecs import hookimpl
from hybridrl_reward_hf.classifier import Reranker, RewardModel
from hybridrl_reward_hf.embedding import EmbeddingSimilarity
from hybridrl_reward_hf.remote import RemoteReward

__version__ = "0.1.0"


@hookimpl
def register_reward_functions(register):
    register("reward_model", RewardModel)
    register("reranker", Reranker)
    register("embedding_similarity", EmbeddingSimilarity)
    register("remote", RemoteReward)


@hookimpl
def register_commands(subparsers):
    from hybridrl_reward_hf.serve import add_command

    add_command(subparsers)
