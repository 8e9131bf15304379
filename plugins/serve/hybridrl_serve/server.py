"""``hybridrl serve``: the run, its trainer, the store, the learner, the batcher and the HTTP API of
one process (the package docstring, docs/online.md)."""

from __future__ import annotations

import json
import time
import uuid

from hybridrl_http.batcher import Batcher
from hybridrl_http.chat import assistant_message, cut_at_stop, reply
from hybridrl_http.commands import model_name, require_token
from hybridrl_http.openai import TokenText

from hybridrl import plugins
from hybridrl.checkpoint import make_private, private_files
from hybridrl.components import Sampling, SamplingParams
from hybridrl.config import ConfigError
from hybridrl.prompts import encode_prompt
from hybridrl_serve.api import TOKEN_ENV, BadRequest, make_server
from hybridrl_serve.learner import Learner
from hybridrl_serve.store import STORE, FeedbackStore

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
    try:
        plugins.lookup("tool parser", cfg.section("online").tool_parser)
    except plugins.PluginError as e:
        raise ConfigError(f"online.tool_parser: {e}") from None


def tool_parser(run, name: str):
    """The tool-call parser ``name`` with its default options (the format the chat template teaches)."""
    return run.build("tool parser", name, plugins.lookup("tool parser", name).Options())


def answer_id(reply_id: str, choice: int) -> str:
    """The stored answer of a reply's choice: the reply's id for the first, ``ID:CHOICE`` after."""
    return reply_id if choice == 0 else f"{reply_id}:{choice}"


def check_policy_alone(algorithm, name: str) -> None:
    """The learner trains the policy alone: an algorithm with models of its own (a critic) is refused."""
    if algorithm.trained_models():
        raise ConfigError(
            f"hybridrl serve trains the policy alone: algorithm '{name}' also trains "
            f"{', '.join(m.label for m in algorithm.trained_models())}. "
            "Use algorithm grpo (or ppo with critic: false)."
        )


class Server:
    """The run, its trainer, the learner, the store and the HTTP server of one ``hybridrl serve``.

    The run is built as ``hybridrl train`` builds it (``build_run``) and its trainer is the loop
    ``hybridrl train`` runs, used for its loop alone: ``resume``, ``open``, and ``close`` at the end
    (``on_train_end`` runs); the run's engine session answers the users (the batcher's one call at a
    time) and the learner trains through ``train_on``."""

    def __init__(
        self, cfg, host: str = "127.0.0.1", port: int = 8000, token: str | None = None, allow: tuple[str, ...] = ()
    ):
        from hybridrl.run import build_run
        from hybridrl.trainer import Trainer

        check_config(cfg)
        require_token("serve", host, token, TOKEN_ENV)  # before loading any model
        if cfg.trainer.run_dir:  # serving continues the run of that folder, if it has checkpoints
            cfg.trainer.resume = True
        self.options = cfg.section("online")
        self.model_id, self.rollout, self.started = model_name(cfg.model.path), cfg.rollout, time.time()
        with private_files():  # the run folder, config.yaml, the logs and the store: the owner's alone
            run = build_run(cfg, name="serve")
            try:  # what fails before the trainer opens releases the engine and the rewards
                check_policy_alone(run.algorithm, cfg.algorithm.name)
                self.trainer = t = Trainer(run)
                self.store = FeedbackStore(run.run_dir / STORE)
                self.learner = Learner(t, self.store)
                self.tokens = TokenText(run.tokenizer)  # the text and bytes of tokens, for logprobs
                self.parser = tool_parser(run, self.options.tool_parser)  # tool calls in answers to 'tools'
                t.extra_state["online"] = self.learner
                t.resume()  # the newest checkpoint of run_dir, when there is one: version and learner state
            except BaseException:
                run.close()
                raise
            t.open()  # no last step: it serves until stopped
        make_private(run.run_dir)  # files an earlier version wrote
        self.batcher = Batcher(self._generate, self.options.batch_requests)
        self.http = make_server(self, host, port, token, self.options, allow)

    @property
    def url(self) -> str:
        host, port = self.http.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def version(self) -> int:
        """The policy version the engine's weights hold: the one the next answer gets."""
        return self.trainer.run.session.version

    # -- what the API asks ------------------------------------------------------------------

    def answer(self, request: dict) -> dict:
        """Sample the ``n`` answers of a checked chat request (:func:`hybridrl_http.chat.chat`) with
        the current weights, store each (rated by the reply's id and its choice), and reply."""
        cfg, tokenizer = self.trainer.config, self.trainer.run.tokenizer
        messages, tools, n = request["messages"], request["tools"], request["n"]
        try:
            prompt_ids, _ = encode_prompt({cfg.data.prompt_column: messages}, cfg.data, tokenizer, tools)
        except ConfigError as e:
            raise BadRequest(400, str(e)) from None
        seeds = [uuid.uuid4().int % 2**31 for _ in range(n)]  # each answer its own sample
        samples = self.batcher.submit([prompt_ids] * n, seeds, request["max_tokens"])
        reply_id, created, answers, choices = f"chatcmpl-{uuid.uuid4().hex}", time.time(), [], []
        for i, sample in enumerate(samples):
            a, text = cut_at_stop(sample, request["stop"], lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
            message, finish, _ = assistant_message(text, tools, a["finish_reason"], self.parser)
            answers.append(
                {"id": answer_id(reply_id, i), "created": created, "version": a["version"],
                 "messages": json.dumps(messages), "prompt_ids": prompt_ids, "response_ids": a["ids"],
                 "logprobs": a["logprobs"], "text": text, "finish_reason": a["finish_reason"]}
            )  # fmt: skip
            logprobs = self.tokens.logprobs(a["ids"], a["logprobs"]) if request["logprobs"] else None
            choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish})
        self.store.add_answers(answers)
        generated = sum(len(a["response_ids"]) for a in answers)
        return reply(
            "chat.completion", self.model_id, choices, len(prompt_ids), generated,
            id=reply_id, created=int(created), policy_version=answers[0]["version"],
        )  # fmt: skip

    def rate(self, reply_id: str, choice: int, rating: float, preferred: str | None) -> int:
        """Store a rating of a reply's choice (its sequence number) and tell the learner."""
        seq = self.store.add_rating(answer_id(reply_id, choice), rating, preferred)
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

    def _generate(self, prompts: list[list[int]], seeds: list[int], max_tokens: int) -> list[dict]:
        """One sample of up to ``max_tokens`` for each prompt, with the weights of one version (the
        engine session stamps it under the lock of the call)."""
        keys = self.trainer.config.rollout.model_dump(include=set(Sampling.model_fields))
        sampling = SamplingParams(**keys | {"n": 1, "max_tokens": max_tokens, "seed": seeds[0], "seeds": seeds})
        out = self.trainer.run.session.generate(prompts, sampling)
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
        the run as ``hybridrl train`` does (the trainer's ``close``)."""
        self.http.server_close()
        self.learner.stop()
        self.batcher.close()
        self.store.close()
        self.trainer.close(self.learner.last)
