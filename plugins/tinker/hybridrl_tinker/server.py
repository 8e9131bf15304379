"""The Tinker API over HTTP: the paths the ``tinker`` SDK calls (under ``/api/v1``), each answered by
:class:`~hybridrl_tinker.service.TinkerService`, with hybridrl-http's checks (Host, the token, the
body's size) before any body is read.

The SDK sends its key in ``X-API-Key`` (it must start with ``tml-``: a server's token is made so);
``forward_backward`` comes as protobuf, and ``retrieve_future`` answers its result and a sample's
as protobuf (the client asks with ``Accept``), the rest as JSON. A failed call answers 400 with
``{"error"}`` (the SDK raises ``BadRequestError`` with that text); a failed future answers
``{"error", "category"}`` (``tinker.RequestFailedError``). A path the SDK knows and this server does
not serve answers 404 naming it (docs/tinker.md lists them).
"""

from __future__ import annotations

from hybridrl_http.commands import require_token
from hybridrl_http.server import ALLOWED_HOSTS_ENV, HttpError, JsonHandler, JsonServer, Raw, listen

from hybridrl_tinker.futures import UserError

TOKEN_ENV = "HYBRIDRL_TINKER_TOKEN"
PROTO = "application/x-protobuf"
API = "/api/v1"
# what the SDK may call that is not served, and what to do instead
UNSERVED = {
    "copy_weights": "copying checkpoints between projects",
    "save_weights_external": "external weights",
    "create_custom_loss": "server-side custom losses (the SDK's forward_backward_custom runs client-side)",
    "auth/token": "JWT sign-in",
    "join_sampling_session": "joining sampling sessions",
    "retrieve_futures": "batched polling",
    "cancel_future": "cancelling a sample",
}


def routes(service, poll_s: float) -> dict:
    """``{(method, path): function}`` of the served endpoints."""
    s = service

    def retrieve(body: dict):
        kind, reply = s.result(body, poll_s)
        return Raw(reply, PROTO) if kind == "proto" else reply

    post = {
        "client/config": s.client_config,
        "client/dynamic_config": lambda body: {"refresh_interval_sec": 300, "sample_cancel_enabled": False},
        "create_session": s.create_session,
        "session_heartbeat": lambda body: {"type": "session_heartbeat"},
        "telemetry": lambda body: {"status": "accepted"},
        "create_model": s.create_model,
        "get_info": s.get_info,
        "unload_model": s.unload_model,
        "forward_backward": s.forward_backward,
        "optim_step": s.optim_step,
        "save_weights": s.save_weights,
        "save_weights_for_sampler": s.save_weights_for_sampler,
        "load_weights": s.load_weights,
        "weights_info": s.weights_info,
        "create_sampling_session": s.create_sampling_session,
        "asample": s.asample,
        "retrieve_future": retrieve,
    }
    get = {"get_server_capabilities": s.capabilities, "healthz": lambda: {"status": "ok"}}
    out = {("POST", f"{API}/{p}"): f for p, f in post.items()} | {("GET", f"{API}/{p}"): f for p, f in get.items()}
    return out


def make_server(service, host: str, port: int, token: str | None, options, allow: tuple[str, ...] = ()) -> JsonServer:
    """The HTTP server of ``service`` (not started: call serve_forever)."""
    require_token("tinker", host, token, TOKEN_ENV)
    table = routes(service, options.poll_s)

    class Handler(JsonHandler):
        public = frozenset({("GET", f"{API}/healthz")})
        token_header, token_scheme = "X-API-Key", ""
        body_types = ("application/json", PROTO)

        def routes(self):
            return {key: self.user_errors(route) for key, route in table.items()}

        def _dispatch(self, method: str) -> None:
            path = self.path.split("?")[0].rstrip("/")
            if path.startswith(f"{API}/sessions/") and path.endswith("/finish") and method == "POST":
                return self.answer(lambda: {})
            if path.startswith(f"{API}/samplers/") and method == "GET":
                return self.answer(lambda: service.get_sampler(path.rsplit("/", 1)[1]))
            unserved = UNSERVED.get(path.removeprefix(f"{API}/"))
            if unserved:
                return self.answer(lambda: self.refuse(unserved))
            return super()._dispatch(method)

        def answer(self, reply) -> None:
            try:
                self.admit(body=self.command == "POST")
                if self.command == "POST":
                    self.read_body()
                self.send_json(200, self.user_errors(reply)())
            except HttpError as e:
                self.send_json(e.code, {"error": str(e)}, e.headers)

        @staticmethod
        def refuse(what: str):
            raise HttpError(404, f"hybridrl's Tinker server does not serve {what} (docs/tinker.md)")

        @staticmethod
        def user_errors(route):
            def call(*args):
                try:
                    return route(*args)
                except UserError as e:
                    raise HttpError(400, str(e)) from None

            return call

    return listen(
        "tinker",
        host,
        port,
        Handler,
        token=token,
        max_body=options.max_request_bytes,
        max_body_name=f"tinker.max_request_bytes={options.max_request_bytes}",
        allow=allow,
        hint=f"list it with --allow-host or in ${ALLOWED_HOSTS_ENV} to allow it",
    )
