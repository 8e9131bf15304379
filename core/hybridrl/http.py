"""A small JSON-over-HTTP client with timeouts and retries, for plugins that call services; and what
every server of hybridrl shares: the loopback check, the token rule, JSON replies, binding.

Standard library only. Every failure names the component, the URL and what to check, and
nothing waits forever: each attempt has a timeout and the number of attempts is bounded.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def require_token(command: str, host: str, token: str | None, env: str) -> None:
    """A server on an address other machines reach needs a token: ConfigError otherwise."""
    from hybridrl.errors import ConfigError

    if not is_loopback(host) and not token:
        raise ConfigError(
            f"{command}: --host {host} accepts connections from other machines, and no token is set. "
            f"Pass --token (or set {env}), or keep the default --host 127.0.0.1."
        )


class JsonHandler(BaseHTTPRequestHandler):
    """A request handler that answers JSON, and checks ``token`` (None: no token) when asked."""

    protocol_version = "HTTP/1.1"
    token: str | None = None

    def log_message(self, *args):  # no request lines: they would say nothing the replies do not
        pass

    def send_json(self, code: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def authorized(self) -> bool:
        """Whether the request sent the token; False after replying 401."""
        sent = self.headers.get("Authorization", "").encode()
        if self.token and not hmac.compare_digest(sent, f"Bearer {self.token}".encode()):
            self.send_json(401, {"error": "missing or wrong token: send 'Authorization: Bearer <token>'"})
            return False
        return True


def listen(command: str, host: str, port: int, handler: type[JsonHandler]) -> ThreadingHTTPServer:
    """A threading server on ``host:port`` (not started), or a ConfigError naming the port's problem."""
    from hybridrl.errors import ConfigError

    try:
        return ThreadingHTTPServer((host, port), handler)
    except OSError as e:
        raise ConfigError(
            f"{command}: cannot listen on {host}:{port} ({e.strerror or e}). Pick another --port (0: any free one)."
        ) from None


def is_loopback(host: str) -> bool:
    """Whether a listening address is reachable from this machine only (127.0.0.1, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ServiceError(RuntimeError):
    """A service did not answer usefully; the message says which one and why."""


def post_json(
    url: str,
    payload,
    *,
    component: str,
    timeout: float = 60.0,
    retries: int = 3,
    backoff: float = 0.5,
    token: str | None = None,
    method: str = "POST",
):
    """POST ``payload`` as JSON and return the decoded JSON answer.

    Retries connection errors, timeouts and 5xx/429 answers ``retries`` times with
    exponential backoff; a 4xx answer fails at once with the server's message.
    """
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    last = None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                body = response.read()
                return json.loads(body) if body else None
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            last = f"HTTP {e.code}: {detail}"
            if e.code < 500 and e.code != 429:
                raise ServiceError(f"{component}: {url} answered {last}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            reason = getattr(e, "reason", e)
            last = f"no answer within {timeout:g}s" if isinstance(reason, TimeoutError) else str(reason)
        except json.JSONDecodeError as e:
            raise ServiceError(f"{component}: {url} did not answer JSON ({e}).") from None
    raise ServiceError(
        f"{component}: {url} failed after {retries + 1} attempts ({last}). Is the server running and "
        "reachable, and is the URL right?"
    )


def get_json(url: str, **kwargs):
    return post_json(url, None, method="GET", **kwargs)
