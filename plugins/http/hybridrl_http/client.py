"""A small JSON-over-HTTP client with timeouts and retries, for plugins that call services (engines'
servers, remote rewards). Standard library only. Every failure names the component, the URL and
what to check, and nothing waits forever: each attempt has a timeout and the number of attempts is
bounded. A redirect is not followed (a token would go along). What hybridrl's own servers share is
:mod:`hybridrl_http.server`.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

MAX_REPLY_BYTES = 256 * 2**20  # the most a client reads of one answer


class ServiceError(RuntimeError):
    """A service did not answer usefully; the message says which one and why."""


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects are answers, not followed: the token would go along to wherever they point."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_opener = urllib.request.build_opener(_NoRedirects)


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
    max_bytes: int = MAX_REPLY_BYTES,
    limit_key: str | None = None,
    text: bool = False,
):
    """POST ``payload`` as JSON and return the decoded JSON answer (``text``: the answer's text, for
    endpoints that answer plain text).

    Retries connection errors, timeouts and 5xx/429 answers ``retries`` times with
    exponential backoff; a 4xx answer fails at once with the server's message. A redirect
    is not followed (the token would go to the address it names): it fails at once, naming it.
    An answer over ``max_bytes`` bytes fails unread, naming the option that raises it (``limit_key``).
    ``token``: a string or a :class:`~hybridrl.options.Secret`."""
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {getattr(token, 'get_secret_value', lambda: token)()}"
    too_big = f"{component}: {url} answered more than {max_bytes} bytes ({max_bytes / 2**20:g} MiB), the most read"
    too_big += f"; raise {limit_key} if its answers are that large." if limit_key else "."
    last = None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with _opener.open(request, timeout=timeout) as response:
                size = response.headers.get("Content-Length", "")
                over = size.isdigit() and int(size) > max_bytes  # said before a byte is read
                body = b"" if over else response.read(max_bytes + 1)
                if over or len(body) > max_bytes:
                    raise ServiceError(too_big)
                if text:
                    return body.decode(errors="replace")
                try:
                    return json.loads(body) if body else None
                except (ValueError, RecursionError) as e:  # not JSON or UTF-8, nested too deep, an int past 4300 digits
                    raise ServiceError(f"{component}: {url} did not answer JSON ({str(e)[:200]}).") from None
        except urllib.error.HTTPError as e:
            if 300 <= e.code < 400:
                where = e.headers.get("Location", "?")[:200]
                raise ServiceError(
                    f"{component}: {url} answered HTTP {e.code}, a redirect to {where}. Redirects are not followed "
                    "(the token would go along): set the URL to the address that answers."
                ) from None
            detail = e.read(4096).decode(errors="replace")[:500]
            last = f"HTTP {e.code}: {detail}"
            if e.code < 500 and e.code != 429:
                raise ServiceError(f"{component}: {url} answered {last}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            reason = getattr(e, "reason", e)
            last = f"no answer within {timeout:g}s" if isinstance(reason, TimeoutError) else str(reason)
    raise ServiceError(
        f"{component}: {url} failed after {retries + 1} attempts ({last}). Is the server running and "
        "reachable, and is the URL right?"
    )


def get_json(url: str, **kwargs):
    return post_json(url, None, method="GET", **kwargs)
