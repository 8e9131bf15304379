"""The run config's ``tenants`` section: a tenant's name and what it has of its own (docs/tenants.md)."""

from __future__ import annotations

import re
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, RootModel, field_validator, model_validator

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
#: what a tenant may set of the trainer section: its optimizer, its schedule, the order of its prompts
TRAINER_KEYS = ("lr", "weight_decay", "warmup_steps", "lr_schedule", "min_lr_ratio", "max_grad_norm", "seed")


class Tenant(BaseModel):
    """One adapter of the run, over the base every tenant shares."""

    model_config = ConfigDict(extra="forbid")

    data: dict[str, Any] = Field(
        default_factory=dict,
        description="The tenant's prompts: keys over the top-level data section (all of it, where it names a "
        "source), its eval sets included.",
    )
    rewards: list[dict[str, Any]] | None = Field(
        None, description="The tenant's reward functions, in place of the top-level rewards."
    )
    lora_path: str | None = Field(
        None,
        description="A peft adapter folder the tenant starts from, of the run's rank, alpha and target modules "
        "(model.lora); default: the run's starting adapter (model.lora.path, or a fresh one).",
    )
    trainer: dict[str, Any] = Field(
        default_factory=dict,
        description=f"The tenant's own {', '.join(TRAINER_KEYS)} (its optimizer, schedule and prompt order); the "
        "rest of the trainer section is the run's.",
    )

    @field_validator("trainer")
    @classmethod
    def _own_keys(cls, value: dict) -> dict:
        shared = sorted(set(value) - set(TRAINER_KEYS))
        if shared:
            raise ValueError(
                f"trainer.{shared[0]} is the run's, the same for every tenant: set it in the top-level trainer "
                f"section. A tenant sets only {', '.join(TRAINER_KEYS)}."
            )
        return value


class TenantsOptions(RootModel[dict[str, Tenant]]):
    """``hybridrl tenants``: the tenants by name, each a LoRA adapter with its own data, rewards and optimizer
    over the run's one frozen base (docs/tenants.md)."""

    root: dict[str, Tenant] = Field(default_factory=dict)
    ITEM: ClassVar = Tenant  # the keys of each tenant (docs/config.md)

    @model_validator(mode="before")
    @classmethod
    def _tenant_keys(cls, value):
        for name, tenant in (value or {}).items() if isinstance(value, dict) else ():
            unknown = sorted(set(tenant or {}) - set(Tenant.model_fields)) if isinstance(tenant, dict) else []
            if unknown:
                raise ValueError(
                    f"tenant {name!r} sets {unknown[0]!r}: a tenant sets {', '.join(Tenant.model_fields)}; the model, "
                    "the engine, the algorithm and the rest are the run's, shared by every tenant"
                )
        return value

    @model_validator(mode="after")
    def _names(self):
        seen: dict[str, str] = {}
        for name in self.root:
            if not NAME.fullmatch(name):
                raise ValueError(
                    f"tenant name {name!r}: up to 64 letters, digits, '_', '.' and '-', from a letter or digit (it "
                    "names the tenant's folder and its metrics)"
                )
            if name.lower() in seen:
                raise ValueError(
                    f"tenants {seen[name.lower()]!r} and {name!r} collide: their folders are one where the file "
                    "system ignores case. Rename one"
                )
            seen[name.lower()] = name
        return self
