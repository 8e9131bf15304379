"""``hybridrl serve``: the trainer, the store, the learner, the batcher and the HTTP API of one
process (the package docstring, docs/online.md)."""

from __future__ import annotations

import json
import time
import uuid

from hybridrl.checkpoint import make_private, private_files
from hybridrl.components import Sampling, SamplingParams
from hybridrl.config import ConfigError
from hybridrl.http_server import require_token
from hybridrl.online.api import TOKEN_ENV, BadRequest, make_server
from hybridrl.online.batcher import Batcher
from hybridrl.online.learner import Learner
from hybridrl.online.store import FeedbackStore
from hybridrl.prompts import encode_prompt

LOCAL_LOGGERS = {"console", "jsonl", "tensorboard"}  # answers and ratings stay on this machine


def check_config(cfg) -> None:
    """What ``hybridrl serve`` needs of a run config, said before any model loads."""
    if cfg.trainer.lr_schedule != "constant":
        raise ConfigError(
            "hybridrl serve trains for as long as it serves: set trainer.lr_schedule: constant "
            f"(a {cfg.trainer.lr_schedule} decay needs a last step; trainer.warmup_steps still applies)."
        )
    if [r.function for r in cfg.rewards] != ["user_rating"]:
        raise ConfigError(
            "hybridrl serve trains on users' ratings: set rewards: [{function: user_rating}] "
            f"(the config has {', '.join(r.function for r in cfg.rewards)})."
        )
    remote = sorted(set(cfg.logging.loggers) - LOCAL_LOGGERS)
    if remote:
        raise ConfigError(
            f"hybridrl serve keeps answers and ratings on this machine: logging.loggers {', '.join(remote)} would "
            f"send them elsewhere. Use {', '.join(sorted(LOCAL_LOGGERS))}."
        )
    if cfg.rollout.agent is not None:
        raise ConfigError("hybridrl serve answers single turns with an engine in this process: unset rollout.agent.")


def check_policy_alone(algorithm, name: str) -> None:
    """The learner trains the policy alone: an algorithm with models of its own (a critic) is refused."""
    if algorithm.trained_models():
        raise ConfigError(
            f"hybridrl serve trains the policy alone: algorithm '{name}' also trains "
            f"{', '.join(m.label for m in algorithm.trained_models())}. "
            "Use algorithm grpo (or ppo with critic: false)."
        )


class Server:
    """The trainer, its learner, the store and the HTTP server of one ``hybridrl serve``.

    The trainer is used as ``hybridrl train`` uses it: ``setup``, ``resume``, ``open``, and
    ``close`` at the end (``on_train_end`` runs); its engine session answers the users (the
    batcher's one call at a time) and the learner trains through ``train_on``."""

    def __init__(
        self, cfg, host: str = "127.0.0.1", port: int = 8000, token: str | None = None, allow: tuple[str, ...] = ()
    ):
        from hybridrl.trainer import Trainer

        check_config(cfg)
        require_token("serve", host, token, TOKEN_ENV)  # before loading any model
        if cfg.trainer.run_dir:  # serving continues the run of that folder, if it has checkpoints
            cfg.trainer.resume = True
        self.trainer = t = Trainer(cfg, name="serve")
        with private_files():  # the run folder, config.yaml, the logs and the store: the owner's alone
            t.setup()
            check_policy_alone(t.algorithm, cfg.algorithm.name)
            self.store = FeedbackStore(t.run_dir / "online.sqlite")
            self.learner = Learner(t, self.store)
            t.extra_state["online"] = self.learner
            t.resume()  # the newest checkpoint of run_dir, when there is one: version and learner state
            t.open()  # no last step: it serves until stopped
        make_private(t.run_dir)  # files an earlier version wrote
        self.batcher = Batcher(self._generate, cfg.online.batch_requests)
        self.http = make_server(self, host, port, token, cfg.online, allow)

    @property
    def url(self) -> str:
        host, port = self.http.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def version(self) -> int:
        """The policy version the engine's weights hold: the one the next answer gets."""
        return self.trainer.session.version

    # -- what the API asks ------------------------------------------------------------------

    def answer(self, messages: list[dict], max_tokens: int | None) -> dict:
        """Generate one answer to ``messages`` with the current weights and store it."""
        cfg, tokenizer = self.trainer.config, self.trainer.tokenizer
        try:
            prompt_ids, _ = encode_prompt({cfg.data.prompt_column: messages}, cfg.data, tokenizer)
        except ConfigError as e:
            raise BadRequest(400, str(e)) from None
        limit = cfg.rollout.max_tokens
        if max_tokens is not None and not (isinstance(max_tokens, int) and 0 < max_tokens <= limit):
            raise BadRequest(400, f"'max_tokens' must be an integer from 1 to {limit} (rollout.max_tokens)")
        a = self.batcher.submit(prompt_ids, max_tokens or limit)
        answer = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "created": time.time(),
            "version": a["version"],
            "messages": json.dumps(messages),
            "prompt_ids": prompt_ids,
            "response_ids": a["ids"],
            "logprobs": a["logprobs"],
            "text": tokenizer.decode(a["ids"], skip_special_tokens=True),
            "finish_reason": a["finish_reason"],
        }
        self.store.add_answer(answer)
        return answer

    def rate(self, answer_id: str, rating: float, preferred: str | None) -> int:
        """Store a rating (its sequence number) and tell the learner."""
        seq = self.store.add_rating(answer_id, rating, preferred)
        self.learner.wake.set()
        return seq

    def status(self) -> dict:
        counts = self.store.counts(self.learner.consumed, time.time() - 600)
        return {
            "policy_version": self.version,
            "learning": self.learner.learning,
            "learner_error": self.learner.error,
            "answers": counts["answers"],
            "ratings": counts["ratings"],
            "untrained_ratings": counts["pending"],
            "rating_mean": counts["mean"],
        }

    def health(self) -> str:
        return "ok" if self.learner.error is None else "learner stopped"

    def _generate(self, prompts: list[list[int]], max_tokens: int) -> list[dict]:
        """One sample of up to ``max_tokens`` for each prompt, with the weights of one version (the
        engine session stamps it under the lock of the call)."""
        keys = self.trainer.config.rollout.model_dump(include=set(Sampling.model_fields))
        sampling = SamplingParams(**keys | {"n": 1, "max_tokens": max_tokens, "seed": uuid.uuid4().int % 2**31})
        out = self.trainer.session.generate(prompts, sampling)
        return [
            {"ids": ids, "logprobs": lp, "finish_reason": reason, "version": out.policy_version}
            for ids, lp, reason in zip(out.token_ids, out.logprobs, out.finish_reasons)
        ]

    # -- running ----------------------------------------------------------------------------

    def serve_forever(self) -> None:
        self.learner.start()
        try:
            self.http.serve_forever()
        finally:
            self.close()

    def close(self) -> None:
        """Stop what only serve owns (HTTP, the learner's thread, the batcher, the store), then end
        the run as ``hybridrl train`` does (:meth:`hybridrl.trainer.Trainer.close`)."""
        self.http.server_close()
        self.learner.stop()
        self.batcher.close()
        self.store.close()
        self.trainer.close(self.learner.last)
