"""The dashboard's web server: a Starlette app over a run directory's JSONL files, run by uvicorn.

The page (``static/``) polls the JSON endpoints; each endpoint first reads what was appended to
the files since the last request, so the page follows a run that is still going.

- ``GET /api/run``: ``{"name", "run_dir", "config": config.yaml text or null, "total_steps"}``
- ``GET /api/metrics?version=V&after=S``: metric rows with ``step > S``; when the file was
  rewritten since version ``V`` (a resumed run trims it), all rows and ``"reset": true``.
- ``GET /api/distribution?version=V&after=S``: per step with samples, the list of each
  numeric sample field (``score``, ``reward/<name>``, ``advantage``).
- ``GET /api/samples?step=S``: the sample rows of one step.
- ``GET /vendor/plotly.min.js``: plotly.js from the installed ``plotly`` Python package.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import threading
from pathlib import Path

import yaml

STATIC = Path(__file__).parent / "static"
NUMERIC_SAMPLE_FIELDS = ("score", "advantage")


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

    def metric_rows(self, version: int | None, after: int) -> dict:
        self.metrics.refresh()
        tail = self.metrics
        reset = version != tail.version
        rows = tail.rows if reset else [r for r in tail.rows if r["step"] > after]
        return {"version": tail.version, "reset": reset, "rows": rows, "bad_lines": tail.bad_lines}

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
        path = self.run_dir / "config.yaml"
        text = path.read_text(errors="replace") if path.is_file() else None
        total = None
        try:
            total = ((yaml.safe_load(text) or {}).get("trainer") or {}).get("steps") if text else None
        except (yaml.YAMLError, AttributeError):
            pass
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
        raise ImportError("hybridrl dashboard needs the plotly package: pip install 'hybridrl[dashboard]'")
    path = Path(next(iter(spec.submodule_search_locations))) / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise ImportError(f"The installed plotly package has no {path.name}; reinstall it: pip install -U plotly")
    return path


def create_app(run_dir: Path, poll_ms: int = 2000):
    """The Starlette app serving the dashboard of ``run_dir``."""
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
        return HTMLResponse(html, headers={"Cache-Control": "no-store"})

    def run_info(request):
        return JSONResponse(files.info())

    def metrics(request):
        return JSONResponse(files.metric_rows(_int(request, "version"), _int(request, "after", 0)))

    def distribution(request):
        return JSONResponse(files.distribution(_int(request, "version"), _int(request, "after", 0)))

    def samples(request):
        step = _int(request, "step")
        if step is None:
            return JSONResponse({"error": "query parameter 'step' (an integer) is required"}, status_code=400)
        return JSONResponse({"step": step, "rows": files.samples_of(step)})

    def plotly(request):
        return FileResponse(js, media_type="text/javascript", headers={"Cache-Control": "max-age=86400"})

    return Starlette(
        routes=[
            Route("/", index),
            Route("/api/run", run_info),
            Route("/api/metrics", metrics),
            Route("/api/distribution", distribution),
            Route("/api/samples", samples),
            Route("/vendor/plotly.min.js", plotly),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ]
    )


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
    sock.listen(128)
    return sock


def serve(run_dir: Path, host: str = "127.0.0.1", port: int = 8265, poll_ms: int = 2000) -> None:
    """Serve the dashboard until interrupted; prints the URL first (flushed) once listening."""
    import uvicorn

    app = create_app(run_dir, poll_ms)
    sock = bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    print(f"hybridrl dashboard: http://{shown}:{bound_port}/ (run {run_dir}; Ctrl-C to stop)", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
