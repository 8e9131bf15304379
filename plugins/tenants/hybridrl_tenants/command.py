"""The ``hybridrl tenants CONFIG`` command: train every tenant of the config's ``tenants`` section."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from hybridrl import __version__
from hybridrl.config import ConfigError, load_config


def add_command(subparsers) -> None:
    p = subparsers.add_parser(
        "tenants", help="Train several LoRA adapters (tenants) over one frozen base, each with its own data, rewards."
    )
    p.add_argument("config", help="YAML run config with model.lora and a tenants section (docs/tenants.md).")
    p.add_argument("overrides", nargs="*", help="Dotted overrides: trainer.steps=5 tenants.math.trainer.lr=2e-5")
    p.add_argument("--resume", action="store_true", help="Continue every tenant from the last step they all saved.")
    p.set_defaults(func=cmd_tenants)


def cmd_tenants(args) -> int:
    from hybridrl.run import build_run
    from hybridrl_tenants.configs import check_run, check_tenants, start_folders, tenant_configs
    from hybridrl_tenants.loop import Tenants

    overrides = [*args.overrides, "trainer.resume=true"] if args.resume else list(args.overrides)
    cfg = load_config(args.config, ["data.source=null", *overrides])  # the tenants bring the data
    names = check_run(cfg)
    if cfg.trainer.resume and not cfg.trainer.run_dir:
        raise ConfigError("--resume needs trainer.run_dir: the directory of the tenants' run to continue.")
    if not cfg.trainer.run_dir:
        cfg.trainer.run_dir = f"runs/tenants-{Path(args.config).stem}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
        overrides.append(f"trainer.run_dir={cfg.trainer.run_dir}")
    configs = tenant_configs(args.config, overrides, cfg, Path(cfg.trainer.run_dir))
    checked = check_tenants(configs)  # every tenant's data and rewards, before the model loads
    folders = start_folders(cfg, args.config)  # and the adapter folders tenants start from
    cfg.data.max_prompt_tokens = max(c.ctx.prompt_tokens for c in checked.values())  # the engine's buffers
    calls = cfg.trainer.prompts_per_step * cfg.rollout.n
    cfg.model.lora.adapters = len(names)  # an engine that mixes adapters holds every tenant's
    run = build_run(cfg, "tenants", data=False, calls=calls)
    try:
        tenants = Tenants(run, configs, checked, folders)
    except BaseException:
        run.close()
        raise
    print(
        f"hybridrl {__version__}: tenants {', '.join(names)} over {cfg.model.path}, one adapter each; run directory "
        f"{tenants.run.run_dir} (each tenant's in tenants/NAME)",
        flush=True,
    )
    last = tenants.train()
    for name, metrics in last.items():
        print(f"done: tenant {name}, final reward {metrics.get('reward/mean', float('nan')):.3f}", flush=True)
    return 0
