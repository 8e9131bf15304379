"""The HTTP API of ``hybridrl serve``: OpenAI's ``POST /v1/chat/completions`` (its request keys
and reply, as every hybridrl server answers them: :mod:`hybridrl_http.chat`) and ``GET /v1/models``,
with ``POST /v1/feedback``, ``GET /v1/status`` and ``GET /health``. Errors are OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, so that OpenAI's clients show the message.

On 127.0.0.1 unless told otherwise, with a token (the command makes one unless ``--no-token``, never
off loopback), request size and rate limits, and the checks every server of hybridrl makes
(:mod:`hybridrl_http.server`: Host and Origin, the token before the body, throttled wrong tokens,
JSON too deep or with lone surrogates refused, timeouts). The endpoints are methods of
:class:`Api`, which checks a request and calls the server (:class:`hybridrl_serve.server.Server`).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from urllib.parse import quote

from hybridrl_http import chat
from hybridrl_http.commands import require_token
from hybridrl_http.openai import BadRequest, OpenAIHandler
from hybridrl_http.server import ALLOWED_HOSTS_ENV, EventStream, HttpError, JsonServer, listen

TOKEN_ENV = "HYBRIDRL_SERVE_TOKEN"


def json_object(body) -> dict:
    if not isinstance(body, dict):
        raise BadRequest(400, "the body must be a JSON object")
    return body


def parse_rating(value, o) -> float:
    """A number in [rating_min, rating_max], or 'up' / 'down' (thumbs)."""
    if value in ("up", "down"):
        return o.rating_max if value == "up" else o.rating_min
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not o.rating_min <= value <= o.rating_max:
        raise BadRequest(
            400, f"'rating' must be a number from {o.rating_min:g} to {o.rating_max:g}, or 'up' / 'down'", "rating"
        )
    return float(value)


class RateLimit:
    """At most ``per_minute`` requests per client address in any 60 seconds."""

    def __init__(self, per_minute: int):
        self.per_minute, self.seen, self.lock = per_minute, defaultdict(deque), threading.Lock()

    def allow(self, client: str) -> bool:
        now = time.monotonic()
        with self.lock:
            times = self.seen[client]
            while times and now - times[0] > 60:
                times.popleft()
            if len(times) >= self.per_minute:
                return False
            times.append(now)
            return True


class Api:
    """The endpoints: each checks its request, then asks ``server`` (``answer``, ``rate``,
    ``status``, ``health``, and ``model_id``, ``rollout``, ``tokens``, ``started`` for what it says
    of the model); ``options``: the config's ``online`` section."""

    def __init__(self, server, options):
        self.server, self.options, self.limit = server, options, RateLimit(options.requests_per_minute)

    def routes(self) -> dict:
        model = self.server.model_id
        return {
            ("GET", "/health"): self.health,
            ("GET", "/v1/status"): self.server.status,
            ("GET", "/v1/models"): self.models,
            ("GET", f"/v1/models/{quote(model, safe='')}"): self.model,
            ("GET", f"/v1/models/{model}"): self.model,
            ("POST", "/v1/chat/completions"): self.chat,
            ("POST", "/v1/feedback"): self.feedback,
        }

    def throttle(self, client: str) -> None:
        if not self.limit.allow(client):
            per_minute = self.options.requests_per_minute
            raise HttpError(429, f"over {per_minute} requests a minute", {"Retry-After": "60"})

    def health(self) -> dict:
        return {"status": self.server.health()}

    def model(self) -> dict:
        """The one model serve answers with, as OpenAI's ``GET /v1/models/{id}`` describes one."""
        return {
            "id": self.server.model_id,
            "object": "model",
            "created": int(self.server.started),
            "owned_by": "hybridrl",
        }

    def models(self) -> dict:
        """OpenAI's model list: the policy, under the name ``model_id``."""
        return {"object": "list", "data": [self.model()]}

    def chat(self, body) -> dict | EventStream:
        request = chat.chat(body, self.server.rollout)
        reply = self.server.answer(request)
        return chat.stream(reply, request["usage_in_stream"]) if request["stream"] else reply

    def feedback(self, body) -> dict:
        body = json_object(body)
        answer_id, choice = body.get("id"), body.get("choice", 0)
        if not isinstance(answer_id, str):
            raise BadRequest(400, "'id' must be the id of a chat completion", "id")
        if isinstance(choice, bool) or not isinstance(choice, int) or not 0 <= choice < chat.MAX_N:
            raise BadRequest(400, f"'choice' must be the index of one of the reply's choices (0 to {chat.MAX_N - 1})")
        rating = parse_rating(body.get("rating"), self.options)
        preferred = body.get("preferred")
        if preferred is not None and not isinstance(preferred, str):
            raise BadRequest(400, "'preferred' must be a string: the answer the user would have wanted", "preferred")
        seq = self.server.rate(answer_id, choice, rating, preferred)
        return {"id": answer_id, "choice": choice, "rating": rating, "stored": True, "seq": seq}


def make_server(server, host: str, port: int, token: str | None, options, allow: tuple[str, ...] = ()) -> JsonServer:
    """The HTTP server of ``server`` (not started: call serve_forever). A non-loopback ``host`` needs a
    ``token``; ``allow``: Host names and origins it answers beside the loopback ones and
    ``$HYBRIDRL_ALLOWED_HOSTS``."""
    require_token("serve", host, token, TOKEN_ENV)
    api = Api(server, options)

    class Handler(OpenAIHandler):
        public = frozenset({("GET", "/health")})  # a load balancer's or supervisor's probe needs no token

        def routes(self):
            return {key: self.noting_param(route) for key, route in api.routes().items()}

        def throttle(self):
            api.throttle(self.client_address[0])

    return listen(
        "serve",
        host,
        port,
        Handler,
        token=token,
        max_body=options.max_request_bytes,
        max_body_name=f"online.max_request_bytes={options.max_request_bytes}",
        allow=allow,
        hint=f"list it with --allow-host or in ${ALLOWED_HOSTS_ENV} to allow it",
    )
