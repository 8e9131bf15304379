"""The ``hybridrl tinker CONFIG`` command: the Tinker API over the run's model until Ctrl-C.

The SDK sends its key in ``X-API-Key`` and only one that starts with ``tml-``, so the server's token
does: ``--token``, ``$HYBRIDRL_TINKER_TOKEN``, or a random one made and printed at the start (any
user of this machine can reach 127.0.0.1, and would otherwise train and sample on it)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hybridrl_http.commands import add_server_options, choose_token, model_name

from hybridrl import __version__
from hybridrl.config import ConfigError, load_config


def add_command(subparsers) -> None:
    p = subparsers.add_parser(
        "tinker", help="Serve the Tinker training API (forward_backward, optim_step, sample) over a local model."
    )
    p.add_argument("config", help="YAML run config with model.path and model.lora (docs/tinker.md).")
    p.add_argument("overrides", nargs="*", help="Dotted overrides: tinker.max_models=4")
    from hybridrl_tinker.server import TOKEN_ENV

    add_server_options(p, 8001, TOKEN_ENV, "train and sample on the server's model")
    p.set_defaults(func=cmd_tinker)


def check_config(cfg) -> None:
    if not cfg.model.lora:
        raise ConfigError(
            "hybridrl tinker trains LoRA adapters over one frozen base, one per client: set model.lora "
            "(e.g. {r: 32, alpha: 32, target_modules: all-linear}; r is the rank clients create)."
        )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("hybridrl tinker runs in one process: start it without torchrun.")


def cmd_tinker(args) -> int:
    from hybridrl.run import build_run
    from hybridrl_tinker.server import TOKEN_ENV, make_server
    from hybridrl_tinker.service import TinkerService

    cfg = load_config(args.config, ["data.source=null", *args.overrides])  # clients bring the data
    check_config(cfg)
    given = args.token or os.environ.get(TOKEN_ENV)
    if given and not given.startswith("tml-"):
        raise ConfigError(f"the Tinker SDK sends only keys that start with 'tml-': make the token 'tml-{given}'")
    token = choose_token("tinker", args.host, given, TOKEN_ENV, args.no_token, "train and sample")
    token = token if token is None or token.startswith("tml-") else f"tml-{token}"
    if not cfg.trainer.run_dir:  # the same folder each time: checkpoints outlive a restart
        cfg.trainer.run_dir = f"runs/tinker-{Path(args.config).stem}"
    run = build_run(cfg, "tinker", data=False)
    service = TinkerService(run, cfg.section("tinker"), model_name(cfg.model.path))
    try:
        server = make_server(service, args.host, args.port, token, cfg.section("tinker"), tuple(args.allow_host))
    except BaseException:
        service.close()
        run.close()
        raise
    host, port = server.server_address[:2]
    print(
        f"hybridrl {__version__}: serving the Tinker API for {', '.join(service.names)} on http://{host}:{port} "
        f"(set TINKER_BASE_URL to it); rank-{service.slots.rank} LoRA clients; run directory {run.run_dir}",
        flush=True,
    )
    if token:
        shown = "<token>' (the token given)" if given else f"{token}' (a new random token; --token or ${TOKEN_ENV})"
        print(f"tinker: clients send it as TINKER_API_KEY='{shown}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("tinker: stopped", file=sys.stderr)
    finally:
        server.server_close()
        service.close()
        run.close()
    return 0
