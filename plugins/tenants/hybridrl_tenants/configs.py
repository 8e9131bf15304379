"""Each tenant's run config: the top-level config with the tenant's data, rewards and trainer keys, and
its folder ``RUN_DIR/tenants/NAME``; every tenant is checked as a run checks its own config
(:func:`hybridrl.preflight.check`: its data, its rewards' fields, its eval sets) before any model loads."""

from __future__ import annotations

import copy
import os
from pathlib import Path

from hybridrl import lora, preflight
from hybridrl.config import LoraOptions, RunConfig, load_config
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


def start_folders(cfg: RunConfig, path: str | Path) -> dict[str, dict]:
    """Each tenant's own starting adapter (``lora_path``, beside the config file or as given), read and
    checked as a LoRA folder (:func:`hybridrl.lora.read_folder`) before the model loads."""
    out = {}
    for name, tenant in cfg.section("tenants").root.items():
        if tenant.lora_path is not None:
            folder = Path(tenant.lora_path).expanduser()
            beside = Path(path).resolve().parent / folder
            folder = beside if not folder.is_absolute() and beside.exists() else folder
            options = LoraOptions(path=str(folder))
            out[name] = lora.read_folder(options, f"tenants.{name}.lora_path") | {"path": str(folder)}
    return out


def check_shape(name: str, saved: dict, run_config: dict) -> None:
    """A tenant's folder has the run's rank, alpha and target modules: every tenant's factors fill the one
    set of LoRA layers the policy has (:class:`hybridrl_tenants.slots.Slots`)."""
    for key in ("r", "lora_alpha", "target_modules", "use_rslora", "rank_pattern", "alpha_pattern"):
        theirs, mine = saved["config"].get(key), run_config.get(key)
        theirs, mine = (sorted(v) if isinstance(v, list | set) else v for v in (theirs, mine))
        if theirs != mine and (theirs or mine):
            raise ConfigError(
                f"{saved['where']} has {key} {theirs!r} where this run's adapters have {mine!r} (model.lora): every "
                "tenant's adapter has the run's rank, alpha and target modules (they share the policy's LoRA layers)."
            )
