"""The ``hybridrl serve CONFIG`` command: its flags, and the server run until Ctrl-C.

Every request needs a token unless ``--no-token``: ``--token``, ``$HYBRIDRL_SERVE_TOKEN``, or a random
one made and printed at the start, since any user of this machine can reach 127.0.0.1 and would
otherwise chat with the policy and rate it, which steers what it learns."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hybridrl_http.commands import add_server_options, choose_token

from hybridrl import __version__
from hybridrl.config import ConfigError, load_config


def add_command(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="Answer users with the policy and learn from their ratings (docs/online.md)."
    )
    p.add_argument("config", help="YAML run config with rewards: [{function: user_rating}].")
    p.add_argument("overrides", nargs="*", help="Dotted overrides: online.update_every=32")
    from hybridrl_serve.api import TOKEN_ENV

    add_server_options(p, 8000, TOKEN_ENV, "chat and rate")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from hybridrl_serve.api import TOKEN_ENV
    from hybridrl_serve.server import Server

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("hybridrl serve runs in one process: start it without torchrun.")
    cfg = load_config(args.config, args.overrides)
    if not cfg.trainer.run_dir:  # the same folder each time: a restart continues from its checkpoints
        cfg.trainer.run_dir = f"runs/serve-{Path(args.config).stem}"
    given = args.token or os.environ.get(TOKEN_ENV)
    steer = "chat with the policy and rate its answers (steer its training)"
    token = choose_token("serve", args.host, given, TOKEN_ENV, args.no_token, steer)
    server = Server(cfg, args.host, args.port, token, allow=tuple(args.allow_host))
    print(
        f"hybridrl {__version__}: serving policy version {server.version} on {server.url} "
        f"(POST /v1/chat/completions, GET /v1/models, POST /v1/feedback, GET /v1/status); "
        f"run directory {server.trainer.run.run_dir}",
        flush=True,
    )
    if token:
        made = f"{token}' (a new random token; --token or ${TOKEN_ENV} sets one)"
        shown = "<token>' (the token given)" if given else made
        print(f"serve: send with every request 'Authorization: Bearer {shown}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print(f"serve: stopped at policy version {server.version}", file=sys.stderr)
    return 0
