"""The dashboard's web server: a Starlette app over a run directory's JSONL files, run by uvicorn.

The page (``static/``) polls the JSON endpoints; each endpoint first reads what was appended to
the files since the last request, so the page follows a run that is still going.

- ``GET /api/run``: ``{"name", "run_dir", "config": config.yaml text, its secrets redacted, or null,
  "total_steps"}``
- ``GET /api/metrics?version=V&from=N``: the metric rows from the file's row N on, and ``next``, the
  N of the next request (``after=S`` instead: the rows with ``step > S``); when the file was
  rewritten since version ``V`` (a resumed run trims it), all rows and ``"reset": true``. A step may
  have several rows (an evaluation's row follows its step's): the page merges them.
- ``GET /api/distribution?version=V&after=S``: per step with samples, the list of each
  numeric sample field (``score``, ``reward/<name>``, ``advantage``).
- ``GET /api/samples?step=S``: the sample rows of one step.
- ``GET /vendor/plotly.min.js``: plotly.js from the installed ``plotly`` Python package.

Every request must name the server as this machine does (Host, and Origin when a page sends
one: hybridrl_http.server.HostCheck), or it gets 403, and carry the token (:class:`Guard`), or it
gets 401 (429 after many wrong ones): any user of this machine reaches 127.0.0.1, and the run's
samples are its owner's. A connection has REQUEST_TIMEOUT seconds for a request's headers, at most
:data:`CONCURRENCY` connections and requests are handled at once (more get 503, uvicorn's
``limit_concurrency``), and an unexpected error is logged with an id, which alone is the reply.
"""

from __future__ import annotations

import hmac
import importlib.util
import json
import os
import socket
import threading
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote

import yaml
from hybridrl_http.server import (
    ALLOWED_HOSTS_ENV,
    BACKLOG,
    REQUEST_TIMEOUT,
    FailedTokens,
    HostCheck,
    allowed_hosts,
    internal_error,
)

from hybridrl.config_files import redact
from hybridrl_dashboard import INSTALL

STATIC = Path(__file__).parent / "static"
NUMERIC_SAMPLE_FIELDS = ("score", "advantage")
CONCURRENCY = 64  # connections and requests at once; a page needs a few
NEED_TOKEN = (
    "missing or wrong token: open the URL that 'hybridrl dashboard' printed (it ends in ?token=...), "
    "or send 'Authorization: Bearer <token>'"
)


class JsonlTail:
    """Rows of a JSONL file that another process appends to, read incrementally.

    A line counts once it ends with a newline (a half-written last line waits). When the file
    is replaced, shrinks or starts with other bytes than before (a new run rewrote it), it is
    read again from the start and :attr:`version` increases.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.rows: list[dict] = []
        self.version = 0
        self.bad_lines = 0
        self._offset = 0
        self._inode = None
        self._head = b""  # the file's first bytes: a file rewritten in place starts differently
        self._lock = threading.Lock()

    def refresh(self) -> bool:
        """Read what was appended; returns True when the rows were reset (file rewritten)."""
        with self._lock:
            try:
                st = os.stat(self.path)
            except FileNotFoundError:
                reset = bool(self.rows)
                if reset:
                    self._reset()
                return reset
            with open(self.path, "rb") as f:
                reset = False
                if st.st_ino != self._inode or st.st_size < self._offset or f.read(len(self._head)) != self._head:
                    if self._inode is not None:  # replaced, truncated or rewritten: read it again
                        self._reset()
                        reset = True
                    self._inode = st.st_ino
                if st.st_size == self._offset:
                    return reset
                f.seek(self._offset)
                chunk = f.read(st.st_size - self._offset)
                if self._offset == 0:
                    self._head = chunk[:256]
            end = chunk.rfind(b"\n")
            if end < 0:
                return reset
            self._offset += end + 1
            for line in chunk[: end + 1].splitlines():
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    self.bad_lines += 1
                    continue
                if isinstance(row, dict) and isinstance(row.get("step"), int):
                    self.rows.append(row)
                else:
                    self.bad_lines += 1
            return reset

    def _reset(self) -> None:
        self.rows, self._offset, self._inode, self._head = [], 0, None, b""
        self.version += 1


class RunFiles:
    """The JSONL files of one run directory."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.metrics = JsonlTail(self.run_dir / "metrics.jsonl")
        self.samples = JsonlTail(self.run_dir / "samples.jsonl")

    def metric_rows(self, version: int | None, after: int, start: int | None = None) -> dict:
        self.metrics.refresh()
        tail = self.metrics
        reset = version != tail.version
        if reset:
            rows = tail.rows
        elif start is not None:
            rows = tail.rows[start:]
        else:
            rows = [r for r in tail.rows if r["step"] > after]
        return {
            "version": tail.version,
            "reset": reset,
            "rows": rows,
            "next": len(tail.rows),
            "bad_lines": tail.bad_lines,
        }

    def distribution(self, version: int | None, after: int) -> dict:
        self.samples.refresh()
        tail = self.samples
        reset = version != tail.version
        steps: dict[int, dict[str, list]] = {}
        for row in tail.rows:
            if not reset and row["step"] <= after:
                continue
            fields = steps.setdefault(row["step"], {})
            for key, value in row.items():
                if key in NUMERIC_SAMPLE_FIELDS or key.startswith("reward/"):
                    fields.setdefault(key, []).append(value if isinstance(value, (int, float)) else None)
        out = [{"step": s, "n": len(next(iter(f.values()), [])), "values": f} for s, f in sorted(steps.items())]
        return {"version": tail.version, "reset": reset, "steps": out}

    def samples_of(self, step: int) -> list[dict]:
        self.samples.refresh()
        return [r for r in self.samples.rows if r["step"] == step]

    def info(self) -> dict:
        """The run's name and config, its secrets redacted (a config.yaml that is not a YAML mapping
        is not shown: it could not be redacted)."""
        path = self.run_dir / "config.yaml"
        text = path.read_text(errors="replace") if path.is_file() else None
        config = None
        try:
            config = yaml.safe_load(text) if text else None
        except yaml.YAMLError:
            text = "(config.yaml is not valid YAML)"
        if isinstance(config, dict):
            text = yaml.safe_dump(redact(config), sort_keys=False)
        elif text is not None and config is not None:
            text = "(config.yaml is not a YAML mapping)"
        total = ((config or {}).get("trainer") or {}).get("steps") if isinstance(config, dict) else None
        return {
            "name": self.run_dir.resolve().name,
            "run_dir": str(self.run_dir),
            "config": text,
            "total_steps": total if isinstance(total, int) else None,
        }


def plotly_js() -> Path:
    """plotly.min.js shipped inside the installed ``plotly`` package (found without importing it)."""
    spec = importlib.util.find_spec("plotly")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"hybridrl dashboard needs the plotly package. {INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise ImportError(f"The installed plotly package has no {path.name}; reinstall it: pip install -U plotly")
    return path


def create_app(run_dir: Path, poll_ms: int = 2000, hosts: HostCheck | None = None, token: str | None = None):
    """The Starlette app serving the dashboard of ``run_dir``; ``hosts``: the Host and Origin headers it
    answers (None: any, for tests that call the app in-process); ``token``: the one every request
    must carry (None: none, ``--no-token``)."""
    from starlette.applications import Starlette
    from starlette.responses import FileResponse, HTMLResponse, JSONResponse
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    files = RunFiles(run_dir)
    js = plotly_js()

    def _int(request, name, default=None):
        raw = request.query_params.get(name)
        try:
            return int(raw) if raw not in (None, "") else default
        except ValueError:
            return default

    def index(request):
        html = (STATIC / "index.html").read_text().replace("__POLL_MS__", str(int(poll_ms)))
        return HTMLResponse(html, headers={"Cache-Control": "no-store", "Referrer-Policy": "same-origin"})

    def run_info(request):
        return JSONResponse(files.info())

    def metrics(request):
        return JSONResponse(
            files.metric_rows(_int(request, "version"), _int(request, "after", 0), _int(request, "from"))
        )

    def distribution(request):
        return JSONResponse(files.distribution(_int(request, "version"), _int(request, "after", 0)))

    def samples(request):
        step = _int(request, "step")
        if step is None:
            return JSONResponse({"error": "query parameter 'step' (an integer) is required"}, status_code=400)
        return JSONResponse({"step": step, "rows": files.samples_of(step)})

    def plotly(request):
        return FileResponse(js, media_type="text/javascript", headers={"Cache-Control": "max-age=86400"})

    def failed(request, exc):
        return JSONResponse(internal_error("dashboard", f"GET {request.url.path[:100]}", exc), status_code=500)

    app = Starlette(
        routes=[
            Route("/", index),
            Route("/api/run", run_info),
            Route("/api/metrics", metrics),
            Route("/api/distribution", distribution),
            Route("/api/samples", samples),
            Route("/vendor/plotly.min.js", plotly),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ],
        exception_handlers={Exception: failed},
    )
    if hosts is None and token is None:
        return app
    return Guard(app, hosts, token, f"hybridrl_dashboard_{hosts.port}" if hosts else "hybridrl_dashboard")


class Guard:
    """``app`` behind the checks of hybridrl_http.server: the Host and Origin (``hosts``; 403), then the
    token (401; 429 once an address sent many wrong ones, the right one always passing). The token
    comes as ``Authorization: Bearer``, as ``?token=`` (the URL the command prints) or as the cookie
    ``cookie``, which a request with the right ``?token=`` sets (HttpOnly: no script reads it;
    SameSite=Strict: no other site's page sends it), so that the page's own requests carry it."""

    def __init__(self, app, hosts: HostCheck | None, token: str | None, cookie: str):
        self.app, self.hosts, self.token, self.cookie = app, hosts, token, cookie
        self.failures = FailedTokens()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers: dict[str, list[str]] = {}
        for key, value in scope["headers"]:
            headers.setdefault(key.decode("latin-1").lower(), []).append(value.decode("latin-1"))
        reason = self.hosts.refusal(headers.get("host"), headers.get("origin")) if self.hosts else None
        if reason:
            return await self.refuse(403, reason, {}, scope, receive, send)
        if self.token is not None:
            query = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token", [])
            if self.right(query):
                send = self.setting_cookie(send)
            elif not self.right(self.sent(headers)):
                error = self.failures.refusal((scope.get("client") or ("",))[0], NEED_TOKEN)
                return await self.refuse(error.code, str(error), error.headers, scope, receive, send)
        await self.app(scope, receive, send)

    def right(self, candidates: list[str]) -> bool:
        expected = self.token.encode()
        return any(hmac.compare_digest(c.encode(), expected) for c in candidates)

    def sent(self, headers: dict[str, list[str]]) -> list[str]:
        """The tokens of the Authorization headers and of the dashboard's cookie."""
        out = [v[len("Bearer ") :] for v in headers.get("authorization", []) if v.startswith("Bearer ")]
        for line in headers.get("cookie", []):
            for part in line.split(";"):
                name, _, value = part.strip().partition("=")
                if name == self.cookie:
                    out.append(unquote(value))
        return out

    def setting_cookie(self, send):
        cookie = f"{self.cookie}={quote(self.token, safe='')}; Path=/; HttpOnly; SameSite=Strict".encode()

        async def sending(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", cookie)]}
            await send(message)

        return sending

    @staticmethod
    async def refuse(code: int, reason: str, headers: dict, scope, receive, send):
        from starlette.responses import JSONResponse

        await JSONResponse({"error": reason}, status_code=code, headers=headers)(scope, receive, send)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free port chosen by the OS)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(
            f"hybridrl dashboard cannot listen on {host}:{port} ({e.strerror}). "
            "Pick another port with --port, or --port 0 for any free one."
        ) from None
    sock.listen(BACKLOG)
    return sock


def timed_protocol():
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request's headers within
    REQUEST_TIMEOUT seconds of opening or of its last reply (uvicorn's own keep-alive timeout stops
    counting once any byte arrives, so a client sending a byte at a time would hold it forever)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11Protocol(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self):
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def _arm(self):
            self._disarm()
            self._deadline = self.loop.call_later(REQUEST_TIMEOUT, self._expire, self.cycle)

        def _disarm(self):
            if getattr(self, "_deadline", None) is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self, cycle):
            if self.cycle is cycle or self.cycle is None:  # no new request's headers since it was armed
                self.transport.close()

    return TimedH11Protocol


def serve(
    run_dir: Path,
    host: str = "127.0.0.1",
    port: int = 8265,
    poll_ms: int = 2000,
    allow: tuple[str, ...] = (),
    token: str | None = None,
) -> None:
    """Serve the dashboard until interrupted; prints the URL first (flushed) once listening, with
    ``?token=`` when there is a ``token`` (None: every request is answered). ``allow``: Host names and
    origins it answers beside the loopback ones and ``$HYBRIDRL_ALLOWED_HOSTS``."""
    import uvicorn

    sock = bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    hint = f"list it with --allow-host or in ${ALLOWED_HOSTS_ENV} to allow it"
    app = create_app(run_dir, poll_ms, HostCheck(host, bound_port, allowed_hosts(allow), hint), token)
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    query = f"?token={quote(token, safe='')}" if token else ""
    print(f"hybridrl dashboard: http://{shown}:{bound_port}/{query} (run {run_dir}; Ctrl-C to stop)", flush=True)
    if token:
        print(f"dashboard: API clients send 'Authorization: Bearer {token}'", flush=True)
    config = uvicorn.Config(
        app,
        http=timed_protocol(),
        log_level="warning",
        access_log=False,
        timeout_keep_alive=5,
        limit_concurrency=CONCURRENCY,
    )
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
