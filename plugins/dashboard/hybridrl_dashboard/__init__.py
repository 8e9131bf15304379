"""``hybridrl dashboard RUN_DIR``: a local web page with a run's curves, reward distributions
and rollout samples, following the run while it goes (it reads metrics.jsonl and samples.jsonl).

A first-party plugin (the ``hybridrl-dashboard`` distribution, entry point ``dashboard``): it adds
the command through ``register_commands`` and reads the run only through its files. The server
libraries are imported only when the command runs, so ``hybridrl --help`` stays fast.

Every request needs a token unless ``--no-token``: ``--token``, ``$HYBRIDRL_DASHBOARD_TOKEN``, or a
random one, printed in the page's URL (``?token=``), as notebook servers do: any user of this machine
reaches 127.0.0.1, and the run folder is its owner's alone.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hybridrl_http.commands import add_server_options, choose_token, is_loopback

from hybridrl.hookspecs import hookimpl

__version__ = "0.1.0"
DEFAULT_PORT = 8265
TOKEN_ENV = "HYBRIDRL_DASHBOARD_TOKEN"
INSTALL = "Install the plugin with its dependencies: pip install ./plugins/dashboard (in hybridrl's checkout)"


@hookimpl
def register_commands(subparsers):
    p = subparsers.add_parser(
        "dashboard",
        help="Serve a web page with a run's curves and samples (updates live).",
        description="Serve a local web page with the reward, KL and length curves, the reward "
        "distribution per step and a browser of rollout samples of RUN_DIR. The page follows the "
        "run while it is going.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="A run directory (holding metrics.jsonl).")
    p.add_argument("--poll", type=float, default=2.0, help="Seconds between the page's refreshes (default 2).")
    add_server_options(p, DEFAULT_PORT, TOKEN_ENV, "read the run", "printed in the page's URL")
    p.set_defaults(func=cmd_dashboard)


def cmd_dashboard(args) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(
            f"RUN_DIR '{run_dir}' is not a directory. Give a run directory such as runs/<config>-<time> "
            "(trainer.run_dir of the run)."
        )
    if not (run_dir / "metrics.jsonl").exists():
        print(f"note: {run_dir} has no metrics.jsonl yet; the page will show it once the run writes it.")
    exposes = "read the run's samples and config"
    token = choose_token(
        "dashboard", args.host, args.token or os.environ.get(TOKEN_ENV), TOKEN_ENV, args.no_token, exposes
    )
    if not is_loopback(args.host):
        print(
            f"warning: binding {args.host}: the page, its token and the run's samples travel unencrypted; "
            "put a proxy with TLS in front to reach it over a network. Requests must name the server by its "
            "address or a name given with --allow-host.",
            file=sys.stderr,
        )
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401

        from hybridrl_dashboard.server import serve
    except ImportError as e:
        raise ImportError(f"hybridrl dashboard needs starlette, uvicorn and plotly ({e}). {INSTALL}") from None
    try:
        serve(run_dir, args.host, args.port, int(args.poll * 1000), tuple(args.allow_host), token)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0
