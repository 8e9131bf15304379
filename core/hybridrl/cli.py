"""``hybridrl train | validate | plugins``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hybridrl import __version__, plugins
from hybridrl.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybridrl", description="RL post-training of LLMs from plugins.")
    parser.add_argument("--version", action="version", version=f"hybridrl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="Run a training job.")
    p.add_argument("config", help="YAML run config.")
    p.add_argument("overrides", nargs="*", help="Dotted overrides: trainer.steps=5 rollout.n=8")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("validate", help="Check a config and its plugins without training.")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("plugins", help="List installed plugins and what they register.")
    p.add_argument("--json", action="store_true", help="Machine-readable output.")
    p.set_defaults(func=cmd_plugins)

    plugins.get_plugin_manager().hook.register_commands(subparsers=sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except (ConfigError, plugins.PluginError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def cmd_train(args) -> int:
    from hybridrl.trainer import Trainer

    cfg = load_config(args.config, args.overrides)
    trainer = Trainer(cfg, name=Path(args.config).stem)
    print(f"hybridrl {__version__}: run directory {trainer.run_dir}", flush=True)
    metrics = trainer.train()
    if metrics:
        print(
            f"done: {cfg.trainer.steps} steps, final reward {metrics.get('reward/mean', float('nan')):.3f}; "
            f"metrics in {trainer.run_dir / 'metrics.jsonl'}"
        )
    return 0


def cmd_validate(args) -> int:
    from hybridrl.models import locate

    cfg = load_config(args.config, args.overrides)
    locate(cfg.model.path)
    print(
        f"{args.config}: OK (rollout '{cfg.rollout.engine}', algorithm '{cfg.algorithm.name}', "
        f"rewards {[r.label for r in cfg.rewards]}, sharding '{cfg.sharding.strategy}', "
        f"data '{cfg.data.source}')"
    )
    return 0


def cmd_plugins(args) -> int:
    infos = plugins.plugin_infos()
    if args.json:
        print(json.dumps([vars(i) for i in infos], indent=2))
        return 0
    for info in infos:
        what = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in info.registered.items())
        print(f"{info.name} ({info.package} {info.version})" + (f" - {what}" if what else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
