"""A small JSON-over-HTTP client with timeouts and retries, for plugins that call services; and the
loopback check of everything that listens.

Standard library only. Every failure names the component, the URL and what to check, and
nothing waits forever: each attempt has a timeout and the number of attempts is bounded.
"""

from __future__ import annotations

import ipaddress
import json
import time
import urllib.error
import urllib.request


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
