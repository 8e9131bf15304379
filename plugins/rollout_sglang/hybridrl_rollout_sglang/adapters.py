"""The policy's LoRA adapter served by SGLang's own LoRA support (``model.lora.sync``: auto or adapter).

An engine in this process starts with LoRA on (``enable_lora``, ``max_lora_rank`` the adapter's
rank, ``lora_target_modules`` its targets, one adapter a batch) where the run will sync adapters.
Each sync registers the adapter under a new name (``load_lora_adapter_from_tensors`` where SGLang
has it, else peft's folder in ``/dev/shm`` and ``load_lora_adapter``), every prompt asks for it by
that name (``lora_path``), and the one before is unloaded: in this process nothing is in flight
during a sync. A server (``rollout.base_url``) must have been started with ``--enable-lora``, a
``--max-lora-rank`` at or above the adapter's rank and ``--lora-target-modules`` covering its
targets: its ``/get_server_info`` says so, and where it does not, the run syncs merged weights and
says why. Before the first sync no adapter is asked for: the base, which is the policy while its
``lora_B`` factors are zero.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hybridrl.engines import lora_plan
from hybridrl.lora import planned_adapter
from hybridrl_rollout_sglang.protocol import COMPONENT


def lora_kwargs(ctx) -> tuple[dict, str | None]:
    """SGLang's LoRA options for a run that syncs adapters (``ctx.lora``), and why not where it cannot."""
    config, why = lora_plan(ctx, "SGLang")
    if why is None and config.get("model_type") == "gpt2":
        why = "SGLang's LoRA does not cover GPT-2's fused Conv1D projections"
    if why is not None:
        return {}, why
    rank, targets = planned_adapter(ctx.lora)
    kwargs = {"enable_lora": True, "max_lora_rank": rank, "lora_target_modules": targets}
    return kwargs | {"max_loras_per_batch": ctx.lora.adapters}, None  # hybridrl tenants: one per tenant


def refusal(config: dict, max_rank: int | None, targets) -> str | None:
    """Why an engine started with ``max_rank`` and ``targets`` (a list, or "all") cannot serve an
    adapter of peft's ``config`` (None: it can)."""
    if config.get("use_dora") or config.get("lora_bias") or config.get("bias", "none") != "none":
        return "SGLang serves plain LoRA: no DoRA, lora_bias or trained biases"
    if config.get("modules_to_save"):
        return "SGLang serves no modules_to_save"
    rank = max([config["r"], *(config.get("rank_pattern") or {}).values()])
    if max_rank is None or rank > max_rank:
        return f"its max_lora_rank is {max_rank}, below the adapter's rank {rank} (--max-lora-rank {rank} serves it)"
    wanted = config.get("target_modules")
    wanted = [wanted] if isinstance(wanted, str) else sorted(wanted or [])
    missing = [] if targets == "all" or targets == ["all"] else sorted(set(wanted) - set(targets or []))
    if missing:
        return f"its lora_target_modules lack {', '.join(missing)} (start it with --lora-target-modules all)"
    return None


def server_refusal(info: dict, config: dict) -> str | None:
    """Why a server whose ``/get_server_info`` is ``info`` cannot serve the adapter (None: it can)."""
    if not info.get("enable_lora"):
        return "the server was started without --enable-lora"
    return refusal(config, info.get("max_lora_rank"), info.get("lora_target_modules"))


def checked(ret, component: str, call: str) -> None:
    """SGLang's LoadLoRAAdapterReqOutput (an object in this process, a dict from a server): raise on failure."""
    success = ret.get("success") if isinstance(ret, dict) else getattr(ret, "success", True)
    if success is False:
        message = ret.get("error_message") if isinstance(ret, dict) else getattr(ret, "error_message", "")
        raise RuntimeError(f"{component}: {call} failed: {message}")


def load_in_process(engine, adapter, name: str, folder: Path | None) -> Path | None:
    """``adapter`` into an ``sglang.Engine`` under ``name`` (from tensors where SGLang has
    ``load_lora_adapter_from_tensors``, else peft's folder under ``folder``, made in /dev/shm where
    there is one); the folder used."""
    if hasattr(engine, "load_lora_adapter_from_tensors"):
        tensors = {n: t.detach().to("cpu", copy=True) for n, t in adapter.tensors}  # SGLang's scheduler reads them
        ret = engine.load_lora_adapter_from_tensors(lora_name=name, tensors=tensors, config_dict=adapter.config)
    else:
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        folder = folder or Path(tempfile.mkdtemp(prefix="hybridrl-sglang-adapters-", dir=shm))
        ret = engine.load_lora_adapter(lora_name=name, lora_path=str(adapter.save(folder / name)))
    checked(ret, COMPONENT, f"loading adapter {name}")
    return folder
