"""``hybridrl serve CONFIG``: answer users with the policy, keep their ratings, learn from them while serving.

A first-party plugin (the ``hybridrl-serve`` distribution, entry point ``serve``; docs/online.md). It
registers the ``serve`` command, the ``user_rating`` reward and the run config's ``online`` section
(:class:`~hybridrl_serve.options.OnlineOptions`). It is a client of the core's loop: it builds a
:class:`~hybridrl.run.Run` and trains through the core's Trainer (``train_on``, ``sync``, ``save``,
``log``). One module per job, imported when the command runs (``hybridrl --help`` stays fast):

- :mod:`~hybridrl_serve.store`: :class:`FeedbackStore`, SQLite in WAL mode
  (``RUN_DIR/online.sqlite``) holding every answer (its messages, prompt and response token ids,
  the engine's logprobs, the policy version that sampled it) and every rating, each write
  committed before the HTTP reply.
- :mod:`~hybridrl_serve.learner`: :class:`Learner`, the thread that trains on the ratings, and the
  advantages it hands the trainer (rating - baseline).
- OpenAI's chat completions, the request keys it answers (tools, ``n``, ``stream``, ``stop``,
  ``logprobs``) and why it refuses the others, and its replies, are hybridrl-http's
  (:mod:`hybridrl_http.chat`), which the agent gateway answers through too, with the sampling keys,
  errors, logprobs and the batcher that answers requests that wait in one engine call
  (:mod:`hybridrl_http.openai`, :mod:`hybridrl_http.batcher`).
- :mod:`~hybridrl_serve.api`: the HTTP endpoints (``/v1/models`` among them), errors in OpenAI's
  shape, and :func:`make_server`.
- :mod:`~hybridrl_serve.server`: :class:`Server`, which holds them all, and :func:`check_config`.
- :mod:`~hybridrl_serve.command`: the ``serve`` command.
"""

from __future__ import annotations

from hybridrl.hookspecs import hookimpl

__version__ = "0.1.0"


@hookimpl
def register_commands(subparsers):
    from hybridrl_serve.command import add_command

    add_command(subparsers)


@hookimpl
def register_reward_functions(register):
    from hybridrl_serve.options import UserRating

    register("user_rating", UserRating)


@hookimpl
def register_config_sections(register):
    from hybridrl_serve.options import OnlineOptions

    register("online", OnlineOptions)
