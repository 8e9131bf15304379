"""What every server of hybridrl shares: binding, the checks made before a request body is read,
JSON replies (standard library only; the client side is :mod:`hybridrl_http.client`).

The servers (``hybridrl serve``, ``serve-reward``, and the dashboard through :class:`HostCheck` and
:class:`FailedTokens`) check, in this order, before reading a body:

1. **Host and Origin** (:class:`HostCheck`): the Host header must name the server as this machine
   does (``127.0.0.1``, ``localhost`` or ``[::1]`` with the server's port, or the address it is
   bound to), and an Origin header, when sent, must be such an address too. A web page elsewhere,
   or one reached through DNS rebinding, gets 403. Other names are allowed with
   ``$HYBRIDRL_ALLOWED_HOSTS`` (and the servers' ``allow`` arguments).
2. **The token** (:func:`hybridrl_http.commands.choose_token`: loopback keeps out other machines, not other users): 401
   without ``Authorization: Bearer <token>``, 429 (:class:`FailedTokens`) to an address's wrong ones
   past ``limit`` in ``window`` s; the right one always passes (behind a proxy all share an address:
   the token's length stops guessers). A public endpoint checks one only when sent (``authorized``).
3. **The body**: a POST must say ``Content-Type: application/json`` (415), and ``Content-Length``
   (411 without it, 400 when it is not a plain number, 413 over the server's limit); JSON nested too
   deeply or with a lone UTF-16 surrogate (``"\\ud800"``) gets 400.

Each connection has :data:`REQUEST_TIMEOUT` seconds to send a whole request (waiting between
requests included), the listen backlog is :data:`BACKLOG`, and an unexpected error is logged with
an id while the reply says only the id.
"""

from __future__ import annotations

import hmac
import io
import json
import math
import os
import re
import sys
import threading
import time
import traceback
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from hybridrl_http.commands import ALLOWED_HOSTS_ENV

BACKLOG = 1024  # connections the kernel queues before the server accepts them (capped by somaxconn)
REQUEST_TIMEOUT = 30.0  # seconds a connection has to send one whole request, the wait before it included
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
BEARER = "missing or wrong token: send 'Authorization: Bearer <token>'"
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # where a body may hold a lone surrogate


# -- what a server checks -------------------------------------------------------------------


def allowed_hosts(extra: Iterable[str] = ()) -> list[str]:
    """``extra`` and the entries of ``$HYBRIDRL_ALLOWED_HOSTS`` (separated by commas or spaces)."""
    return [*extra, *re.split(r"[,\s]+", os.environ.get(ALLOWED_HOSTS_ENV, "").strip())]


class HostCheck:
    """Which Host and Origin headers a server on ``port`` answers: the loopback names with its port, the
    address it is bound to (unless that is every address), and ``allow`` entries. An entry is ``name``
    (that name with or without the server's port), ``name:port``, an origin ``scheme://name[:port]``
    (that origin, and its ``name[:port]`` as Host), or ``*`` (no check: only behind a proxy that checks).
    ``hint`` ends each refusal: where to allow another name."""

    def __init__(self, bound: str, port: int, allow: Iterable[str] = (), hint: str = ""):
        self.port, self.any = port, False
        self.hosts: set[str] = set()
        self.origins: set[str] = set()
        self.hint = hint or f"list it in ${ALLOWED_HOSTS_ENV} to allow it"
        bound = bound.strip("[]")
        names = list(LOOPBACK_NAMES)
        if bound and bound not in ("0.0.0.0", "::"):
            names.append(f"[{bound}]" if ":" in bound else bound)
        for name in names:
            self._allow(name.lower(), port)
        self.shown = ", ".join(f"{n}:{port}" for n in LOOPBACK_NAMES)
        for entry in allow:
            entry = entry.strip().lower().rstrip("/")
            if entry == "*":
                self.any = True
            elif "://" in entry:
                self.origins.add(entry)
                self.hosts.add(entry.split("://", 1)[1])
            elif entry:
                name, entry_port = split_port(entry)
                self._allow(name, entry_port if entry_port is not None else port, bare=entry_port is None)

    def _allow(self, name: str, port: int, bare: bool = False) -> None:
        self.hosts.add(f"{name}:{port}")
        self.origins |= {f"http://{name}:{port}", f"https://{name}:{port}"}
        if bare or port == 80:
            self.hosts.add(name)
            self.origins.add(f"http://{name}")
        if bare or port == 443:
            self.hosts.add(name)
            self.origins.add(f"https://{name}")

    def refusal(self, hosts: list[str] | None, origins: list[str] | None) -> str | None:
        """Why a request with these Host and Origin headers (each a list, as sent) is refused; None: allowed."""
        if self.any:
            return None
        if not hosts or len(hosts) > 1:
            return "a request must send one Host header"
        host = hosts[0].strip().lower()
        if host not in self.hosts:
            return f"Host '{host[:100]}' is not a name of this server ({self.shown}); {self.hint}"
        if origins:
            origin = origins[0].strip().lower()
            if len(origins) > 1 or origin not in self.origins:
                return f"a web page of Origin '{origin[:100]}' may not call this server; {self.hint}"
        return None


def split_port(hostport: str) -> tuple[str, int | None]:
    """``("name", port)`` of ``name:port``, ``[v6]:port`` or a bare name (port None)."""
    if hostport.startswith("["):
        name, _, rest = hostport.partition("]")
        name += "]"
    elif hostport.count(":") == 1:
        name, _, rest = hostport.partition(":")
        rest = ":" + rest
    elif ":" in hostport:  # an IPv6 address without brackets
        return f"[{hostport}]", None
    else:
        return hostport, None
    port = rest.removeprefix(":")
    return name, int(port) if port.isdigit() else None


class FailedTokens:
    """Per client address, the times of its missing or wrong tokens: after ``limit`` of them within
    ``window`` seconds it is refused (429) until the oldest is ``window`` old, so a guesser gets ``limit``
    guesses a window. At most ``addresses`` addresses are remembered (the oldest forgotten first)."""

    def __init__(self, limit: int = 10, window: float = 60.0, addresses: int = 4096):
        self.limit, self.window, self.addresses = limit, window, addresses
        self.times: OrderedDict[str, deque] = OrderedDict()
        self.lock = threading.Lock()

    def wait(self, client: str) -> float:
        """Seconds ``client`` must wait before its token is checked again; 0: it may try now."""
        now = time.monotonic()
        with self.lock:
            times = self.times.get(client)
            while times and now - times[0] > self.window:
                times.popleft()
            if not times:
                self.times.pop(client, None)
                return 0.0
            return self.window - (now - times[0]) if len(times) >= self.limit else 0.0

    def failed(self, client: str) -> None:
        with self.lock:
            self.times.setdefault(client, deque()).append(time.monotonic())
            self.times.move_to_end(client)
            while len(self.times) > self.addresses:
                self.times.popitem(last=False)

    def refusal(self, client: str, message: str = BEARER) -> HttpError:
        """The error for a missing or wrong token from ``client``: 401 with ``message`` (counted), or 429
        once it sent ``limit`` of them (not counted: the window frees a guess when the oldest ages)."""
        wait = self.wait(client)
        if wait:
            headers = {"Retry-After": str(math.ceil(wait))}
            return HttpError(429, "too many wrong tokens from this address: wait and retry", headers)
        self.failed(client)
        return HttpError(401, message)


class EventStream:
    """A route's reply sent as server-sent events (:meth:`JsonHandler.send_events`): ``events``, dicts."""

    def __init__(self, events: list[dict]):
        self.events = events


class Raw:
    """A route's 200 reply that is not JSON: ``data`` sent as ``kind``."""

    def __init__(self, data: bytes, kind: str):
        self.data, self.kind = data, kind


class HttpError(Exception):
    """A request the server refuses: ``code`` is its HTTP status, the message its one-line reason."""

    def __init__(self, code: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.code, self.headers = code, headers or {}


def internal_error(command: str, what: str, exc: BaseException | None = None) -> dict:
    """Log ``exc`` (default: the exception being handled) with a new id; the reply's body, which says
    only the id."""
    ref = uuid.uuid4().hex[:12]
    trace = "".join(traceback.format_exception(exc)) if exc is not None else traceback.format_exc()
    print(f"error: {command}: {what} failed (error id {ref}):\n{trace}", file=sys.stderr, flush=True)
    return {"error": f"internal error (id {ref}): the server's log has the details", "error_id": ref}


class _DeadlineReader(io.RawIOBase):
    """A connection's reads, none past ``deadline`` (time.monotonic()), each at most ``timeout`` seconds."""

    def __init__(self, sock, timeout: float):
        self.sock, self.timeout, self.deadline = sock, timeout, math.inf

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive in time")
        self.sock.settimeout(min(self.timeout, left))
        return self.sock.recv_into(buffer)


class JsonServer(ThreadingHTTPServer):
    """A threading HTTP server with a listen backlog of :data:`BACKLOG` and what its handlers check."""

    request_queue_size = BACKLOG

    def __init__(self, address, handler, *, command, token, max_body, max_body_name, timeout, allow, hint):
        super().__init__(address, handler)
        self.command, self.token, self.request_timeout = command, token, timeout
        self.max_body, self.max_body_name = max_body, max_body_name or f"the limit of {max_body} bytes"
        self.hosts = HostCheck(address[0], self.server_address[1], allowed_hosts(allow), hint)
        self.failures = FailedTokens()


class JsonHandler(BaseHTTPRequestHandler):
    """A request handler that answers JSON. A subclass lists its endpoints in :meth:`routes`; each
    request passes the server's checks (the module docstring) and :meth:`throttle` before its route
    runs, a POST's route gets the decoded JSON body, and what it returns is the 200 reply.
    :class:`HttpError` is answered with its code and message, anything else with 500 and an id."""

    protocol_version = "HTTP/1.1"
    server: JsonServer
    public: frozenset[tuple[str, str]] = frozenset()  # (method, path) of endpoints that need no token
    token_header, token_scheme = "Authorization", "Bearer "  # where the token comes: 'Authorization: Bearer <token>'
    body_types: tuple[str, ...] = ("application/json",)  # a POST's types: JSON decoded, others as bytes

    def routes(self) -> dict[tuple[str, str], Callable]:
        """``{(method, path): function}``: a GET's function takes nothing, a POST's the JSON body."""
        return {}

    def throttle(self) -> None:
        """Called after the common checks, before the route: raise HttpError to refuse."""

    def log_message(self, *args):  # no request lines: they would say nothing the replies do not
        pass

    def setup(self):
        super().setup()
        self.reader = _DeadlineReader(self.connection, self.server.request_timeout)
        self.rfile = io.BufferedReader(self.reader)

    def handle_one_request(self):
        self.reader.deadline = time.monotonic() + self.server.request_timeout
        self.unread = False  # a body this request announced and nobody read: the connection closes after it
        super().handle_one_request()

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        path = urlsplit(self.path).path.rstrip("/") or "/"
        try:
            self.admit(body=method == "POST", token=(method, path) not in self.public)
            self.throttle()
            routes = self.routes()
            route = routes.get((method, path))
            if route is None:
                same = [f"{m} {p}" for m, p in routes if m == method] or [f"{m} {p}" for m, p in routes]
                raise HttpError(404, f"no such endpoint {method} {path[:100]}: use {', '.join(same)}")
            reply = route(self.read_body()) if method == "POST" else route()
        except HttpError as e:
            return self.send_json(e.code, {"error": str(e)}, e.headers)
        except ConnectionError:  # the client went away while its body was read: nobody to answer
            self.close_connection = True
            return
        except Exception:
            reply = internal_error(self.server.command, f"{method} {path[:100]}")
            return self.send_json(500, reply)
        if isinstance(reply, EventStream):
            return self.send_events(reply)
        if isinstance(reply, Raw):
            return self.send_body(200, reply.data, reply.kind)
        self.send_json(200, reply)

    def send_events(self, stream: EventStream) -> None:
        """A 200 reply of server-sent events: ``data: <json>`` per event, then ``data: [DONE]``
        (OpenAI's streams), written as one body whose length is known (the events are ready)."""
        data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in stream.events) + b"data: [DONE]\n\n"
        self.send_body(200, data, "text/event-stream", {"Cache-Control": "no-cache"})

    def admit(self, body: bool, token: bool = True) -> None:
        """The checks of the module docstring, in order; raises HttpError. ``body``: a POST, whose body
        is then announced and acceptable (``self.body_size`` bytes); ``token``: the token is required (else
        it is checked only when sent; ``self.authorized`` says whether the right one came)."""
        s, headers = self.server, self.headers
        lengths = headers.get_all("Content-Length") or []
        self.unread = bool(headers.get("Transfer-Encoding")) or any(v.strip() != "0" for v in lengths)
        self.body_size = 0
        reason = s.hosts.refusal(headers.get_all("Host"), headers.get_all("Origin"))
        if reason:
            raise HttpError(403, reason)
        sent = headers.get(self.token_header)
        self.authorized = not s.token
        if s.token and (token or sent is not None):
            if not hmac.compare_digest((sent or "").encode(), f"{self.token_scheme}{s.token}".encode()):
                raise s.failures.refusal(self.client_address[0])
            self.authorized = True
        if not body:
            return
        self.body_kind = kind = headers.get("Content-Type", "").split(";")[0].strip().lower()
        if kind not in self.body_types:
            told = " or ".join(f"'Content-Type: {t}'" for t in self.body_types)
            raise HttpError(415, f"send the body with {told} (got '{kind[:60]}')")
        if headers.get("Transfer-Encoding"):
            raise HttpError(411, "send the body with a Content-Length (chunked bodies are not accepted)")
        if not lengths:
            raise HttpError(411, "a POST needs a Content-Length header")
        if len(lengths) > 1 or not re.fullmatch(r"[0-9]{1,18}", lengths[0].strip()):
            raise HttpError(400, "Content-Length must be one number of bytes")
        size = int(lengths[0])
        if size > s.max_body:
            raise HttpError(413, f"body of {size} bytes is over {s.max_body_name}")
        self.body_size = size

    def read_body(self):
        """The request's body: JSON decoded (:meth:`read_json`), another accepted type as bytes."""
        return self.read_json() if self.body_kind == "application/json" else self.read_raw()

    def read_raw(self) -> bytes:
        """The request's body (``self.body_size`` bytes, checked by :meth:`admit`)."""
        try:
            data = self.rfile.read(self.body_size)
        except TimeoutError:
            self.close_connection = True
            raise HttpError(408, f"the body did not arrive within {self.server.request_timeout:g} s") from None
        self.unread = False
        if len(data) < self.body_size:
            self.close_connection = True
            raise HttpError(400, f"the body ended after {len(data)} of {self.body_size} bytes")
        return data

    def read_json(self):
        """The request's body (``self.body_size`` bytes, checked by :meth:`admit`), decoded."""
        data = self.read_raw()
        try:
            value = json.loads(data)
            if SURROGATE_ESCAPE.search(data):  # a pair is text; a lone half cannot be encoded, later
                json.dumps(value, ensure_ascii=False).encode()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HttpError(400, f"the body is not JSON: {e}") from None
        except UnicodeEncodeError:
            raise HttpError(400, "a string of the body holds a lone UTF-16 surrogate: send text") from None
        except RecursionError:
            raise HttpError(400, "the body nests JSON arrays or objects too deeply") from None
        return value

    def send_json(self, code: int, body: dict, headers: dict | None = None) -> None:
        self.send_body(code, json.dumps(body).encode(), "application/json", headers)

    def send_body(self, code: int, data: bytes, kind: str, headers: dict | None = None) -> None:
        self.connection.settimeout(self.server.request_timeout)  # a reply may take as long as a request
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("X-Content-Type-Options", "nosniff")
        if self.unread:  # the rest of the stream is that body, not a request
            self.close_connection = True
            self.send_header("Connection", "close")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def send_error(self, code, message=None, explain=None):
        """The standard library's own refusals (a bad request line, an unknown method), as JSON."""
        self.close_connection = True
        self.unread = False
        self.send_json(code, {"error": message or HTTPStatus(code).phrase})


def listen(command: str, host: str, port: int, handler: type[JsonHandler], **options) -> JsonServer:
    """A server on ``host:port`` (not started), or a ConfigError naming the port's problem.
    ``options``: ``token`` required of every request (None: none); ``max_body``, the largest body in
    bytes (65536), which a 413 reply calls ``max_body_name``; ``allow``, more names for
    :class:`HostCheck` beside those of ``$HYBRIDRL_ALLOWED_HOSTS``; ``hint``, where a user allows
    another name; ``timeout``, seconds a connection has for one request (:data:`REQUEST_TIMEOUT`);
    ``port_name``, the option that sets the port (``--port``)."""
    from hybridrl.errors import ConfigError

    port_name = options.pop("port_name", "--port")
    defaults = {"token": None, "max_body": 65536, "max_body_name": "", "allow": (), "hint": ""}
    try:
        return JsonServer((host, port), handler, command=command, **defaults | {"timeout": REQUEST_TIMEOUT} | options)
    except OSError as e:
        raise ConfigError(
            f"{command}: cannot listen on {host}:{port} ({e.strerror or e}). Pick another {port_name} (0: any free one)"
        ) from None
