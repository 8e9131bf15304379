"""The policy's LoRA adapter served by vLLM's own LoRA support (``model.lora.sync``: auto or adapter).

The engine starts with LoRA on (``enable_lora``, ``max_lora_rank`` the smallest rank vLLM allows
at or above ``model.lora.r``) where the run will sync adapters and vLLM can serve them for the
model. Each sync hands the adapter's tensors to the workers (by reference in this process, as
safetensors bytes to workers in other processes), which copy them in vLLM's LoRA dtype to CPU memory,
where vLLM keeps the adapters it reads from folders, and add them to their LoRA manager as a new
adapter, with a new name and id: no folder is written or read (a folder made each sync cost 0.9 s at a
7B shape, rank 32, on an H100). vLLM caches adapters by id and
prompts by name, so a version never reuses another's. It is added before any generate asks for it,
and the one before it of the same name is removed: in this process nothing is in flight during a
sync. Adapters of several names (``hybridrl tenants``: ``model.lora.adapters`` of them) stay loaded
side by side, and a call's prompts each name theirs (``SamplingParams.adapters``). Otherwise every
prompt of a call uses the same adapter (vLLM's CPU kernels mixed requests without an adapter with
those that have one in a batch: vllm PRs 48421, 49656); before the first sync none, the base, which
is the policy while its ``lora_B`` factors are zero.
"""

from __future__ import annotations

import torch

from hybridrl.engines import lora_plan
from hybridrl.lora import planned_adapter

NAME = "rollout engine 'vllm'"
RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values


def lora_kwargs(ctx, sleep_level, dtype: str = "auto", on_gpu: bool = False) -> tuple[dict, str | None]:
    """vLLM's LoRA options for a run that syncs adapters (``ctx.lora``) to an engine of weights in ``dtype``,
    and why not where it cannot."""
    config, why = lora_plan(ctx, "vLLM")
    if not config:  # no adapters, or merged ones
        return {}, why
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_lora

    arch = (config.get("architectures") or ["its architecture"])[0]
    cls = ModelRegistry._try_load_model_cls(arch) if arch in ModelRegistry.get_supported_archs() else None
    if cls is None or not supports_lora(cls):
        return {}, f"vLLM's {arch} has no LoRA support"
    if why is not None:
        return {}, why
    if on_gpu and dtype == "float32":  # its Triton kernels assert 16-bit weights at the first capture
        return (
            {},
            "vLLM's LoRA kernels on a GPU take 16-bit weights, and the engine's are float32 (rollout.dtype: bfloat16)",
        )
    if sleep_level == 2:
        return {}, "sleep_level 2 drops the base weights, which adapter syncs never send again (sleep_level: 1)"
    planned = planned_adapter(ctx.lora)[0]
    rank = next((r for r in RANKS if r >= planned), None)
    if rank is None:
        return {}, f"vLLM serves adapters up to rank {RANKS[-1]} (the adapter's is {planned})"
    held = ctx.lora.adapters  # side by side: one per tenant (hybridrl tenants), each replaced at its syncs
    return {"enable_lora": True, "max_lora_rank": rank, "max_loras": held, "max_cpu_loras": held + 1}, None


def refusal(config: dict, max_rank: int) -> str | None:
    """Why vLLM cannot serve an adapter of peft's ``config`` (None: it can)."""
    if config.get("use_dora") or config.get("lora_bias") or config.get("bias", "none") != "none":
        return "vLLM serves plain LoRA: no DoRA, lora_bias or trained biases"
    if config.get("modules_to_save"):
        return "vLLM serves no modules_to_save"
    if config["r"] > max_rank:
        return f"the engine started with max_lora_rank {max_rank}, below the adapter's rank {config['r']}"
    return None


class Adapters:
    """The adapters vLLM serves: ``request`` (a LoRARequest; None: the base), the one loaded last, for every
    prompt of a call that names none; ``named``, the latest of each name, for calls that name theirs."""

    def __init__(self, llm, multiprocess: bool = False):
        self.llm, self.multiprocess, self.request, self.loads, self.named = llm, multiprocess, None, 0, {}
        self.stats: dict[str, float] = {}

    def load(self, adapter) -> None:
        from vllm.lora.request import LoRARequest

        self.loads += 1
        label = f"{adapter.name}-v{adapter.version}-{self.loads}"
        request = LoRARequest(label, self.loads, lora_path=f"{TENSORS}{label}")  # a name: vLLM reads no folder
        tensors = adapter.tensors
        if self.multiprocess:  # tensors do not survive the trip to other processes; in 16 bits, half the bytes
            from safetensors.torch import save

            dtype = self.llm.llm_engine.vllm_config.lora_config.lora_dtype
            dtype = dtype if isinstance(dtype, torch.dtype) else None
            tensors = save({n: t.detach().to(dtype or t.dtype).contiguous().cpu() for n, t in tensors})
        try:
            loaded = self.llm.collective_rpc("hybridrl_add_adapter", args=(request, tensors, adapter.config))
        except Exception as e:
            raise RuntimeError(f"{NAME}: vLLM did not load version {adapter.version} of the adapter: {e}") from e
        if not all(loaded):
            raise RuntimeError(f"{NAME}: vLLM did not load version {adapter.version} of the adapter.")
        old, self.request = [self.named.pop(adapter.name, None)], request
        if adapter.name != "policy":  # the run's adapters have names (tenants): the one synced at setup goes
            old.append(self.named.pop("policy", None))
        self.named[adapter.name] = request
        for gone in (o for o in old if o is not None):
            self.llm.llm_engine.remove_lora(gone.lora_int_id)
        self.stats = {"vllm/adapter_mib": adapter.nbytes() / 2**20}

    def requests(self, names: list[str] | None):
        """The LoRARequest of each prompt (``names``: each one's adapter: SamplingParams.adapters), or one for all."""
        return self.request if names is None else [self.named[name] for name in names]

    def close(self) -> None:
        self.llm = None  # the engine frees vLLM at once (a late collection would tear down the next one's state)


# -- the worker's side ---------------------------------------------------------------------------

TENSORS = "hybridrl-tensors:"  # the "path" of an adapter added from tensors: never a folder


def add_from_tensors(manager, request, tensors, config: dict) -> bool:
    """Add the adapter of ``request`` to a worker's LoRA ``manager`` (vLLM's LRUCacheWorkerLoRAManager)
    from ``tensors`` under peft's names (a list of pairs, or safetensors bytes) and peft's ``config``.

    The manager's own ``add_adapter`` does the rest (its capacity, activation), with its loader, which
    would read ``request``'s folder, replaced for this call by one that builds vLLM's LoRAModel from
    the tensors as vLLM builds it from a folder: the same config checks, name mapping and dtype.
    """
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    if isinstance(tensors, bytes):
        from safetensors.torch import load

        tensors = list(load(tensors).items())
    models = manager._adapter_manager
    mapper = getattr(models.model, "hf_to_vllm_mapper", None)
    for keeps_constituents in ("get_rename_mapper", "get_unstacked_mapper"):  # vLLM 0.32; 0.26: q_proj stays q_proj
        if hasattr(mapper, keeps_constituents):
            mapper = getattr(mapper, keeps_constituents)()
            break
    expected = {
        m for module in models.supported_lora_modules for m in models.packed_modules_mapping.get(module, [module])
    }
    unexpected = sorted(
        {
            module
            for module in (parse_fine_tuned_lora_name(n, mapper)[0] for n, _ in tensors)
            if module.rsplit(".", 1)[-1] not in expected and ".experts" not in module
        }
    )
    if unexpected:
        raise ValueError(
            f"the adapter has LoRA factors for {unexpected[0]} ({len(unexpected)} modules), where vLLM's "
            f"model takes them for {sorted(expected)}"
        )
    helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    dtype = manager.lora_config.lora_dtype
    dtype = dtype if isinstance(dtype, torch.dtype) else None
    # vLLM's own copy, in (pinned) CPU memory as it keeps the adapters it reads from folders: the adapters of
    # several versions or tenants take no GPU memory beside the engine's share; the trainer's go on changing
    owned = {n: t.detach().to(device="cpu", dtype=dtype or t.dtype, copy=True) for n, t in tensors}

    def from_tensors(req):
        skip = getattr(models.model, "lora_skip_prefixes", None)
        return manager._lora_model_cls.from_lora_tensors(
            req.lora_int_id,
            owned,
            helper,
            device="cpu",
            dtype=dtype,
            model_vocab_size=manager.vocab_size,
            weights_mapper=mapper,
            skip_prefixes=skip,
        )

    manager._load_adapter = from_tensors  # this call's loader (an attribute of the instance, over the method)
    try:
        return manager.add_adapter(request)
    finally:
        del manager._load_adapter
