"""Each tenant's run config: the top-level config with the tenant's data, rewards and trainer keys, and
its folder ``RUN_DIR/tenants/NAME``; every tenant is checked as a run checks its own config
(:func:`hybridrl.preflight.check`: its data, its rewards' fields, its eval sets) before any model loads."""

from __future__ import annotations

import copy
import os
from pathlib import Path

from hybridrl import preflight
from hybridrl.config import RunConfig, load_config
from hybridrl.config_files import apply_overrides, load_yaml
from hybridrl.errors import ConfigError


def check_run(cfg: RunConfig) -> list[str]:
    """The tenants' names, once the top-level config can train them."""
    names = list(cfg.section("tenants").root)
    if not names:
        raise ConfigError(
            "the config names no tenants: add a section tenants: {NAME: {data: ..., rewards: ...}, ...} "
            "(docs/tenants.md), or train one adapter with hybridrl train."
        )
    if not cfg.model.lora:
        raise ConfigError(
            "hybridrl tenants trains a LoRA adapter per tenant over one frozen base: set model.lora "
            "(e.g. {r: 16, alpha: 32, target_modules: all-linear})."
        )
    if cfg.sharding.strategy != "single" or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            f"hybridrl tenants trains in one process (sharding.strategy: single, without torchrun); this config "
            f"sets sharding.strategy '{cfg.sharding.strategy}'. Tenants under fsdp are not supported yet."
        )
    if cfg.rollout.async_ or cfg.rollout.stream:
        raise ConfigError(
            f"rollout.async is {cfg.rollout.async_}: the tenants take their steps in turn through one engine, "
            "which holds the adapter of the tenant whose step it is. Set rollout.async: 0 (and rollout.stream: off)."
        )
    return names


def tenant_configs(path: str | Path, overrides: list[str], cfg: RunConfig, run_dir: Path) -> dict[str, RunConfig]:
    """Each tenant's config: the top-level YAML (with ``overrides``) and the tenant's keys over it. A
    tenant's ``data`` replaces the top's keys it names (all of the section where it names a source), its
    ``rewards`` the top's list, its ``trainer`` keys the top's; its run folder is ``RUN_DIR/tenants/NAME``."""
    raw = apply_overrides(load_yaml(Path(path).read_text(), str(path)) or {}, overrides)
    out = {}
    for name, tenant in cfg.section("tenants").root.items():
        data = copy.deepcopy({k: v for k, v in raw.items() if k != "tenants"})
        own = copy.deepcopy(tenant.data)
        data["data"] = own if "source" in own else {**(data.get("data") or {}), **own}
        if tenant.rewards is not None:
            data["rewards"] = copy.deepcopy(tenant.rewards)
        data["trainer"] = {**(data.get("trainer") or {}), **tenant.trainer, "run_dir": str(run_dir / "tenants" / name)}
        try:
            out[name] = load_config(path, data=data)
        except ConfigError as e:
            raise ConfigError(f"tenants.{name}: {e}") from None
    return out


def check_tenants(configs: dict[str, RunConfig]) -> dict[str, preflight.Checked]:
    """What a run reads first, for each tenant (its prompts, its eval sets), checked; one error names the tenant."""
    out = {}
    for name, tenant in configs.items():
        try:
            out[name] = preflight.check(tenant, train=True, data=True)
        except preflight.FAILURES as e:
            raise ConfigError(f"tenant '{name}': {e}") from None
    return out
