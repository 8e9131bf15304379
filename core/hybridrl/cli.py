"""``hybridrl train | validate | eval | plugins``; plugins add theirs (serve, import, dashboard, export)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hybridrl import __version__, distributed, plugins
from hybridrl.config import ConfigError, load_config
from hybridrl.errors import did_you_mean


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybridrl", description="RL post-training of LLMs from plugins.")
    parser.add_argument("--version", action="version", version=f"hybridrl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_commands(sub)
    plugins.get_plugin_manager().hook.register_commands(subparsers=sub)
    asked = next((a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")), None)
    if asked in plugins.FIRST_PARTY_COMMANDS and asked not in sub.choices:  # its plugin is not installed
        parser.exit(2, f"hybridrl: {plugins.install_hint(asked, plugins.FIRST_PARTY_COMMANDS[asked])}\n")
    args, extra = parser.parse_known_args(argv)
    # overrides may come after options (hybridrl train CFG --resume trainer.run_dir=DIR), which
    # argparse leaves over once the positionals are filled
    if extra and hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from hybridrl.distributed import RankFailure
    from hybridrl.errors import Interrupted, NonFiniteError, StageError

    try:
        return args.func(args) or 0
    except (ConfigError, plugins.PluginError, FileNotFoundError, FileExistsError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (StageError, NonFiniteError, RankFailure) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Interrupted as e:
        print(str(e), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted; nothing was saved after the last checkpoint", file=sys.stderr)
        return 130


def add_commands(sub) -> None:
    """The core's subcommands (plugins add theirs through ``register_commands``)."""
    p = sub.add_parser("train", help="Run a training job.")
    p.add_argument("config", help="YAML run config.")
    p.add_argument("overrides", nargs="*", help="Dotted overrides: trainer.steps=5 rollout.n=8")
    p.add_argument("--resume", action="store_true", help="Continue from the newest checkpoint in trainer.run_dir.")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "validate", help="Run every check a run makes before it loads a model: config, plugins, model folder, data."
    )
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser(
        "eval", help="Evaluate a checkpoint, a model folder or model.path on the data.eval sets (docs/evaluation.md)."
    )
    p.add_argument("config", help="YAML run config with data.eval sets.")
    p.add_argument("overrides", nargs="*", help="Dotted overrides: data.eval.0.n=8")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--checkpoint", metavar="DIR", help="A checkpoint (RUN_DIR/checkpoints/step-N): its policy.")
    model.add_argument("--model", metavar="DIR", help="A model folder (hybridrl export's output); default model.path.")
    p.add_argument("-o", "--output", metavar="FILE", help="The JSON report; default RUN_DIR/report.json.")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("plugins", help="List installed plugins, what they register and which hooks they implement.")
    p.add_argument("--json", action="store_true", help="Machine-readable output.")
    p.add_argument("--hook", help="Only the plugins that implement this hook (e.g. on_step_end).")
    p.set_defaults(func=cmd_plugins)


def cmd_train(args) -> int:
    from hybridrl.run import build_run
    from hybridrl.trainer import Trainer

    overrides = [*args.overrides, "trainer.resume=true"] if args.resume else args.overrides
    cfg = load_config(args.config, overrides)
    trainer = Trainer(build_run(cfg, name=Path(args.config).stem))
    run_dir, main_rank = trainer.run.run_dir, trainer.run.ctx.is_main  # under torchrun, rank 0 speaks
    ranks = trainer.run.ctx.world_size
    if main_rank:
        print(f"hybridrl {__version__}: run directory {run_dir}", flush=True)
    metrics = trainer.train()
    if metrics and main_rank:
        print(
            f"done: {cfg.trainer.steps} steps, final reward {metrics.get('reward/mean', float('nan')):.3f}; "
            f"metrics in {run_dir / 'metrics.jsonl'}"
        )
    return distributed.end_rank(ranks, 0)  # a finished torchrun rank skips the teardown that may abort it


def cmd_eval(args) -> int:
    from hybridrl import evaluation
    from hybridrl.run import build_run

    cfg = load_config(args.config, args.overrides)
    model, step = evaluation.model_to_evaluate(cfg, args.checkpoint, args.model)
    run = build_run(cfg, name=f"eval-{Path(args.config).stem}", train=False)
    try:
        results = run.evaluation.evaluate(step)
    finally:
        run.close()
    if run.ctx.is_main:  # under torchrun, rank 0 writes and speaks
        for r in results:
            evaluation.save_samples(r, run.run_dir / evaluation.EVAL_DIR, step)
        out = Path(args.output) if args.output else run.run_dir / "report.json"
        evaluation.write_report(out, evaluation.report(results, model, step))
        print(f"{model}, step {step}:")
        print(evaluation.table(results))
        print(f"report: {out}; samples: {run.run_dir / evaluation.EVAL_DIR}")
    return 0


def cmd_validate(args) -> int:
    from hybridrl import preflight

    cfg = load_config(args.config, args.overrides)
    preflight.check(cfg)  # what a run checks before it loads a model: the model folder, the data, the engine
    print(
        f"{args.config}: OK (rollout '{cfg.rollout.engine}', algorithm '{cfg.algorithm.name}', "
        f"rewards {[r.label for r in cfg.rewards]}, sharding '{cfg.sharding.strategy}', "
        f"data '{cfg.data.source}')"
    )
    return 0


def cmd_plugins(args) -> int:
    infos = plugins.plugin_infos()
    if args.hook:
        known = sorted(plugins.hook_names())
        if args.hook not in known:
            raise ConfigError(f"Unknown hook '{args.hook}'.{did_you_mean(args.hook, known)} Hooks: {', '.join(known)}.")
        kinds = {k.hook: kind for kind, k in plugins.KINDS.items()} | plugins.REGISTERS
        kind = kinds.get(args.hook)
        infos = [i for i in infos if args.hook in i.hooks or (kind and kind in i.registered)]
    if args.json:
        print(json.dumps([vars(i) for i in infos], indent=2))
        return 0
    for info in infos:
        what = [f"{kind}: {', '.join(names)}" for kind, names in info.registered.items()]
        what += [f"hooks: {', '.join(info.hooks)}"] if info.hooks else []
        print(f"{info.name} ({info.package} {info.version})" + (f" - {'; '.join(what)}" if what else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
