"""The agent gateway: an OpenAI-compatible HTTP endpoint on 127.0.0.1 answered by the run's engine
session, recording each call's exact ids, logprobs and policy version into its episode.

An agent reaches its episode through its base URL, ``http://127.0.0.1:PORT/episodes/EPISODE/v1``
(what ``OPENAI_BASE_URL`` says to a harness), or ``http://127.0.0.1:PORT/v1`` with an
``X-Episode-Id: EPISODE`` header. Every request needs the run's token (``OPENAI_API_KEY``) and
passes the checks of every hybridrl server (:mod:`hybridrl_http.server`).

Calls that arrive together are answered by one engine call (:class:`hybridrl_http.batcher.Batcher`);
each request is seeded on its own, by its episode and its call.
"""

from __future__ import annotations

import math
import re
import secrets
import threading
import time
import uuid
from urllib.parse import unquote, urlsplit

from hybridrl_http import chat as openai_chat
from hybridrl_http.batcher import Batcher
from hybridrl_http.chat import cut_at_stop
from hybridrl_http.openai import BadRequest, OpenAIHandler, TokenText
from hybridrl_http.server import EventStream, listen

from hybridrl.components import SamplingParams
from hybridrl_agents.episodes import Context, Episode, Turn

EPISODE_PATH = re.compile(r"/episodes/([A-Za-z0-9_.:-]{1,128})(/.*)")
EPISODE_HEADER = "X-Episode-Id"
CALL_SEED_STRIDE = 1_000_003


class Gateway:
    """The endpoint of a run's harness episodes: ``loop`` is the run's agent loop (its session
    generates, its tokenizer renders, its budget bounds an episode), ``parser`` reads tool calls,
    ``options`` the harness environment's."""

    def __init__(self, loop, parser, options, model_id: str, token: str | None = None, late=None):
        self.loop, self.parser, self.options, self.model_id = loop, parser, options, model_id
        self.late = late  # late(episode_id, reward): a reward for an episode that has ended, as the store took it
        self.tokenizer, self.rollout = loop.tokenizer, loop.rollout
        self.tokens = TokenText(self.tokenizer)
        self.episodes: dict[str, Episode] = {}
        self.lock = threading.RLock()  # the harness commits an episode and forgets it under it
        self.token = token or secrets.token_urlsafe(32)  # the harnesses' OPENAI_API_KEY
        self.started = time.time()
        self.pending = 0  # the episodes running (opened, not finished): each may send a call
        self.batcher = Batcher(self._generate, options.batch_requests, options.batch_wait_s, lambda: self.pending)
        self.http = make_server(self)
        self.thread = threading.Thread(target=self.http.serve_forever, name="hybridrl-gateway", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.http.server_address[:2]
        return f"http://{host}:{port}"

    def base_url(self, episode: Episode) -> str:
        return f"{self.url}/episodes/{episode.id}/v1"

    def open(self, index: int, row: dict | None, sampling: SamplingParams) -> Episode:
        """A new episode of the rollout call sampled with ``sampling`` (its seed seeds the episode's calls).
        Episodes of calls that run at once (streamed groups, an evaluation beside them) share engine calls
        when they sample alike, and only then."""
        episode = Episode(f"ep-{index}-{uuid.uuid4().hex[:12]}", index, row)
        episode.seed = (sampling.seed or 0) + index
        episode.sampling = sampling.model_copy(update={"n": 1, "seed": None, "seeds": None})
        with self.lock:
            self.episodes[episode.id] = episode
            self.pending += 1  # an engine call waits for the calls of the episodes running (batch_wait_s)
        return episode

    def finish(self, episode: Episode) -> None:
        """No more calls: a late one of a harness that outlived its episode gets 409."""
        with episode.lock:
            if not episode.closed:
                with self.lock:
                    self.pending = max(self.pending - 1, 0)
            episode.closed = True

    def forget(self, episode: Episode) -> None:
        """The episode is in the store: a reward posted from now on goes there (or is refused)."""
        with self.lock:
            self.episodes.pop(episode.id, None)

    def episode(self, episode_id: str | None) -> Episode:
        if not episode_id:
            why = f"no episode: use the base URL .../episodes/ID/v1 or send the {EPISODE_HEADER} header"
            raise BadRequest(404, why)
        found = self.episodes.get(episode_id)
        if found is None:
            raise BadRequest(404, f"unknown episode '{episode_id[:128]}': it never was, or it has ended")
        return found

    # -- answering ---------------------------------------------------------------------------

    def chat(self, episode: Episode, body) -> dict | EventStream:
        request = openai_chat.chat(body, self.rollout)
        with episode.lock:
            self._admit(episode)
            ctx = episode.context(request["messages"], request["tools"], self.tokenizer, self.loop.end_ids)
            answers = self._sample(episode, ctx, request)
            choices, turns = [], []
            for i, a in enumerate(answers):
                a, text = cut_at_stop(a, request["stop"], self._decode)
                message, finish = self._message(text, request["tools"], a["finish_reason"], episode)
                episode.unforced += request["forced"] and "tool_calls" not in message
                turn = Turn(
                    request["messages"], request["tools"], message, ctx.prompt, ctx.ids + a["ids"],
                    ctx.logprobs + a["logprobs"], ctx.sampled + [1] * len(a["ids"]), a["version"], text, finish,
                )  # fmt: skip
                turns.append(turn)
                logprobs = self.tokens.logprobs(a["ids"], a["logprobs"]) if request["logprobs"] else None
                choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish})
            self._record(episode, ctx, turns)
        reply = self._reply("chat.completion", episode, choices, ctx, answers)
        return openai_chat.stream(reply, request["usage_in_stream"]) if request["stream"] else reply

    def completion(self, episode: Episode, body) -> dict | EventStream:
        request = openai_chat.completions(body, self.rollout)
        prompt = request["prompt"]
        ids = prompt if isinstance(prompt, list) else self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if not all(0 <= i < len(self.tokenizer) for i in ids):
            raise BadRequest(400, f"'prompt' holds token ids outside the vocabulary (0 to {len(self.tokenizer) - 1})")
        with episode.lock:
            self._admit(episode)
            ctx = self._completion_context(episode, ids)
            answers = self._sample(episode, ctx, request)
            choices, turns = [], []
            for i, a in enumerate(answers):
                a, text = cut_at_stop(a, request["stop"], self._decode)
                message = {"role": "assistant", "content": text}
                turns.append(
                    Turn([], None, message, ctx.prompt, ctx.ids + a["ids"], ctx.logprobs + a["logprobs"],
                         ctx.sampled + [1] * len(a["ids"]), a["version"], text, a["finish_reason"])
                )  # fmt: skip
                logprobs = self._legacy_logprobs(a) if request["logprobs"] else None
                choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": a["finish_reason"]})
            self._record(episode, ctx, turns)
        reply = self._reply("text_completion", episode, choices, ctx, answers)
        return openai_chat.stream(reply, request["usage_in_stream"]) if request["stream"] else reply

    def post_reward(self, episode_id: str, body) -> dict:
        """``{"reward": number}`` for an episode: once, while the episode is open or waits for it."""
        value = body.get("reward") if isinstance(body, dict) else None
        try:
            value = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
        except OverflowError:
            value = math.nan
        if not math.isfinite(value):
            raise BadRequest(400, "'reward' must be a finite number", "reward")
        with self.lock:  # one lock with forget: a reward lands in the episode or in the store, never between
            episode = self.episodes.get(episode_id)
            if episode is None:
                return self._post_late(episode_id, value)
            with episode.lock:
                if episode.reward is not None:
                    why = f"episode '{episode.id}' already has its reward ({episode.reward:g})"
                    raise BadRequest(409, why, "reward")
                episode.reward = value
        return {"id": episode.id, "reward": value, "stored": True}

    def _post_late(self, episode_id: str, value: float) -> dict:
        """A reward for an episode that has ended: stored if its group is held (late rewards)."""
        status = self.late(episode_id, value) if self.late is not None else "unknown"
        if status == "stored":
            return {"id": episode_id, "reward": value, "stored": True}
        why = {
            "unknown": f"unknown episode '{episode_id[:128]}': it never was, or it has ended",
            "twice": f"episode '{episode_id}' already has its reward",
            "trained": f"episode '{episode_id}' has been trained, or ended before reward_deadline_s held it: "
            "rewards after the rollout need reward_deadline_s",
        }[status]
        raise BadRequest(404 if status == "unknown" else 409, why, "reward")

    def _admit(self, episode: Episode) -> None:
        if episode.closed:
            raise BadRequest(409, f"episode '{episode.id}' has ended: its harness was stopped or timed out")
        if episode.calls >= self.options.max_calls:
            raise BadRequest(
                429,
                f"episode '{episode.id}' made {episode.calls} calls, its limit (max_calls={self.options.max_calls})",
            )

    def _sample(self, episode: Episode, ctx: Context, request: dict) -> list[dict]:
        room = self.loop.budget - len(ctx.ids)
        if room <= 0:
            raise BadRequest(
                400, f"episode '{episode.id}' used its {self.loop.budget} tokens (rollout.agent.max_total_tokens)"
            )
        first = episode.seed + CALL_SEED_STRIDE * episode.calls * openai_chat.MAX_N
        seeds = [first + CALL_SEED_STRIDE * i for i in range(request["n"])]
        episode.calls += 1
        prompts, most = [ctx.engine_prompt] * request["n"], min(request["max_tokens"], room)
        return self.batcher.submit(prompts, seeds, most, settings=episode.sampling)

    def _message(self, text: str, tools, finish: str, episode: Episode) -> tuple[dict, str]:
        """The reply's assistant message (tool calls read by the run's parser) and finish reason."""
        message, finish, malformed = openai_chat.assistant_message(text, tools, finish, self.parser)
        episode.malformed += malformed
        episode.tool_calls += len(message.get("tool_calls", []))
        return message, finish

    def _record(self, episode: Episode, ctx: Context, turns: list[Turn]) -> None:
        for turn in turns:  # what the next call's messages are compared with: as the harness sends it
            turn.reply = openai_chat.messages([{k: v for k, v in turn.reply.items() if k != "refusal"}])[0]
        episode.record(ctx, turns)

    def _completion_context(self, episode: Episode, ids: list[int]) -> Context:
        """A completion prompt that starts with an earlier answer's ids continues it (the rest of
        the prompt is observation), else starts a branch."""
        for turn in reversed(episode.turns):
            done = turn.prompt + turn.ids
            if len(ids) >= len(done) and ids[: len(done)] == done:
                extra = ids[len(done) :]
                return Context(turn.prompt, turn.ids + extra, turn.logprobs + [0.0] * len(extra),
                               turn.sampled + [0] * len(extra), parent=turn)  # fmt: skip
        return Context(list(ids), forked=bool(episode.turns))

    def _reply(self, kind: str, episode: Episode, choices: list[dict], ctx: Context, answers: list[dict]) -> dict:
        generated = sum(len(a["ids"]) for a in answers)
        return openai_chat.reply(kind, self.model_id, choices, len(ctx.engine_prompt), generated,
                                 episode_id=episode.id, policy_version=answers[0]["version"])  # fmt: skip

    def _legacy_logprobs(self, answer: dict) -> dict:
        content = self.tokens.logprobs(answer["ids"], answer["logprobs"])["content"]
        return {"tokens": [c["token"] for c in content], "token_logprobs": [c["logprob"] for c in content]}

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _generate(self, prompts: list[list[int]], seeds: list[int], max_tokens: int, settings) -> list[dict]:
        sampling = settings.model_copy(update={"max_tokens": max_tokens, "seed": seeds[0], "seeds": seeds})
        out = self.loop.session.generate(prompts, sampling)
        return [
            {"ids": ids, "logprobs": lp, "finish_reason": reason, "version": out.policy_version}
            for ids, lp, reason in zip(out.token_ids, out.logprobs, out.finish_reasons)
        ]

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.batcher.close()


def make_server(gateway: Gateway):
    """The gateway's HTTP server on 127.0.0.1 (``port``; 0: any free one), with the run's token."""

    class Handler(OpenAIHandler):
        def routes(self):
            path = urlsplit(self.path).path.rstrip("/")
            found = EPISODE_PATH.fullmatch(path)
            episode_id = unquote(found.group(1)) if found else self.headers.get(EPISODE_HEADER)
            prefix = path[: found.start(2)] if found else ""
            api = {
                ("GET", "/v1/models"): lambda: {"object": "list", "data": [model(gateway)]},
                ("GET", f"/v1/models/{gateway.model_id}"): lambda: model(gateway),
                ("POST", "/v1/chat/completions"): lambda body: gateway.chat(gateway.episode(episode_id), body),
                ("POST", "/v1/completions"): lambda body: gateway.completion(gateway.episode(episode_id), body),
                ("POST", "/reward"): lambda body: gateway.post_reward(episode_id or "", body),
            }
            return {(m, prefix + p): self.noting_param(route) for (m, p), route in api.items()}

    size = gateway.options.max_request_bytes
    return listen("agent gateway", "127.0.0.1", gateway.options.port, Handler, token=gateway.token, max_body=size,
                  max_body_name=f"max_request_bytes={size}", port_name="rollout.agent.port")  # fmt: skip


def model(gateway: Gateway) -> dict:
    return {"id": gateway.model_id, "object": "model", "created": int(gateway.started), "owned_by": "hybridrl"}
