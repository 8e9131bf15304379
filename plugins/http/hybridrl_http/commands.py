"""A server command's options and its token: ``--host``, ``--port``, ``--token`` / ``--no-token``,
``--allow-host``, and the rule that a server other machines reach needs a token (the checks made
with it are :mod:`hybridrl_http.server`'s)."""

from __future__ import annotations

import ipaddress
import secrets
import sys
from pathlib import Path

ALLOWED_HOSTS_ENV = "HYBRIDRL_ALLOWED_HOSTS"


def require_token(command: str, host: str, token: str | None, env: str) -> None:
    """A server on an address other machines reach needs a token: ConfigError otherwise."""
    from hybridrl.errors import ConfigError

    if not is_loopback(host) and not token:
        raise ConfigError(
            f"{command}: --host {host} accepts connections from other machines, and no token is set. "
            f"Pass --token (or set {env}) or leave out --no-token, or keep the default --host 127.0.0.1."
        )


def add_server_options(parser, port: int, env: str, exposes: str, shown: str = "printed") -> None:
    """A server command's ``--host``, ``--port`` (default ``port``), ``--token`` / ``--no-token``
    (:func:`add_token_options`) and ``--allow-host``."""
    parser.add_argument("--host", default="127.0.0.1", help="Address to bind (default 127.0.0.1: this machine only).")
    parser.add_argument("--port", type=int, default=port, help=f"Port (default {port}; 0: any free one).")
    add_token_options(parser, env, exposes, shown)
    allow = "Also answer requests whose Host (or a web page's Origin) is NAME, NAME:PORT or https://NAME; repeatable. "
    allow += f"Default: the loopback names and the bound address only (and ${ALLOWED_HOSTS_ENV})."
    parser.add_argument("--allow-host", action="append", default=[], metavar="NAME", help=allow)


def add_token_options(parser, env: str, exposes: str, shown: str = "printed") -> None:
    """A command's ``--token`` / ``--no-token`` (one or the other): the token every request needs,
    by default ``$ENV`` or a new random one (:func:`choose_token`); ``exposes``: what any local user
    could do without one ("chat and rate"); ``shown``: where a new token is printed."""
    auth = parser.add_mutually_exclusive_group()
    auth.add_argument(
        "--token",
        default=None,
        help=f"Require 'Authorization: Bearer TOKEN' (default: ${env}, else a new random one, {shown}).",
    )
    auth.add_argument(
        "--no-token",
        action="store_true",
        help=f"Answer requests without a token: any user of this machine can then {exposes} (127.0.0.1 only).",
    )


def choose_token(command: str, host: str, given: str | None, env: str, off: bool, exposes: str) -> str | None:
    """``given`` (--token or ``$env``), else a new random token; None only when ``off`` (--no-token) on a
    loopback ``host``, after a warning that every user of this machine can then ``exposes``."""
    if off:
        require_token(command, host, None, env)
        print(f"warning: {command}: --no-token: every user of this machine can {exposes}.", file=sys.stderr)
        return None
    if given and len(given) < 16:
        print(f"warning: {command}: the token has {len(given)} characters: use a long random one.", file=sys.stderr)
    return given or secrets.token_urlsafe(32)


def is_loopback(host: str) -> bool:
    """Whether a listening address is reachable from this machine only (127.0.0.1, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def model_name(path: str) -> str:
    """The model's name in ``/v1/models`` and in replies: a hub id as given, a folder by its own name
    (not where it lies on this machine), ``package:NAME`` as NAME."""
    if path.startswith("package:"):
        return path.split(":", 1)[1]
    folder = Path(path).expanduser()
    return folder.name if folder.is_absolute() or path.startswith(".") or folder.exists() else path
