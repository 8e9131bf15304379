"""``hybridrl serve``: answer users with the policy, keep their ratings, learn from them while serving.

A client of the trainer (docs/online.md): it builds a :class:`~hybridrl.trainer.Trainer`, answers
through its engine session and trains through ``Trainer.train_on``. One module per job:

- :mod:`~hybridrl.online.store`: :class:`FeedbackStore`, SQLite in WAL mode
  (``RUN_DIR/online.sqlite``) holding every answer (its messages, prompt and response token ids,
  the engine's logprobs, the policy version that sampled it) and every rating, each write
  committed before the HTTP reply.
- :mod:`~hybridrl.online.batcher`: :class:`Batcher`, requests that wait answered in one call.
- :mod:`~hybridrl.online.learner`: :class:`Learner`, the thread that trains on the ratings.
- :mod:`~hybridrl.online.api`: the HTTP endpoints and :func:`make_server`.
- :mod:`~hybridrl.online.server`: :class:`Server`, which holds them all, and :func:`check_config`.
"""

from hybridrl.online.api import TOKEN_ENV, BadRequest, make_server
from hybridrl.online.batcher import Batcher
from hybridrl.online.learner import Learner, baselines
from hybridrl.online.server import Server, check_config
from hybridrl.online.store import FeedbackStore

__all__ = [
    "TOKEN_ENV",
    "BadRequest",
    "Batcher",
    "FeedbackStore",
    "Learner",
    "Server",
    "baselines",
    "check_config",
    "make_server",
]
