"""Finding and loading models: paths, GGUF conversion, tokenizers, dtypes, master weights, dropout,
activation checkpointing. The forward passes are :mod:`hybridrl.forward`'s (kernels) and
:mod:`hybridrl.passes`' (planner and runner)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from hybridrl.rope import loadable_folder, pin_long_rope

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOW_PRECISION = (torch.bfloat16, torch.float16)
CONVERSION = 2  # bump when convert_gguf writes something different, so cached folders are rebuilt


class ModelNotFoundError(FileNotFoundError):
    pass


def cache_dir() -> Path:
    root = os.environ.get("HYBRIDRL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hybridrl")
    return Path(root)


def locate(path: str, key: str = "model.path") -> Path:
    """``package:NAME`` -> the folder of an installed package (without importing it); ``key``: the
    option that names ``path``, for errors."""
    if path.startswith("package:"):
        from hybridrl.errors import package_not_installed

        name = path.split(":", 1)[1]
        spec = importlib.util.find_spec(name) if all(p.isidentifier() for p in name.split(".")) else None
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(f"{key} '{path}': {package_not_installed(name)}")
        return Path(list(spec.submodule_search_locations)[0])
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelNotFoundError(
            f"{key} '{path}' does not exist. Give a local Hugging Face model folder "
            "(config.json + weights), or 'package:NAME' for a model shipped in a Python package; "
            "models are never downloaded at run time."
        )
    return p


def check_model_path(
    path: str, gguf_file: str | None = None, key: str = "model.path", gguf_key: str | None = "model.gguf_file"
) -> None:
    """Fail with a message naming the key and the fix when the model is not there; loads nothing.
    ``key``: the option naming ``path``; ``gguf_key``: the option naming a GGUF file in it (None:
    the option takes Hugging Face folders only)."""
    folder = locate(path, key)
    if gguf_file is not None:
        if not (folder / gguf_file).is_file():
            have = ", ".join(sorted(f.name for f in folder.glob("*.gguf"))) or "none"
            raise ModelNotFoundError(f"{gguf_key} '{gguf_file}' is not in {folder} (GGUF files there: {have}).")
    elif not (folder / "config.json").is_file():
        ggufs = ", ".join(sorted(f.name for f in folder.glob("*.gguf")))
        if ggufs and gguf_key is None:
            raise ModelNotFoundError(
                f"{key} '{path}' holds GGUF files only ({ggufs}), and {key} takes a Hugging Face model folder "
                "(config.json + weights): GGUF is read for model.path alone (with model.gguf_file). Give a "
                f"Hugging Face folder, or leave {key} unset where its default is the policy's model."
            )
        hint = f" It holds {ggufs}: set {gguf_key}." if ggufs else ""
        raise ModelNotFoundError(f"{key} '{path}' has no config.json.{hint}")


def resolve_model_path(
    path: str, gguf_file: str | None = None, key: str = "model.path", gguf_key: str | None = "model.gguf_file"
) -> str:
    """A plain HF model folder for ``path``: GGUF files are converted once and cached, and so is a folder
    whose first-release rope keys transformers 5 refuses (:func:`hybridrl.rope.loadable_folder`)."""
    check_model_path(path, gguf_file, key, gguf_key)
    folder = locate(path, key)
    return str(loadable_folder(folder, cache_dir()) if gguf_file is None else convert_gguf(folder / gguf_file))


def convert_gguf(gguf: Path) -> Path:
    """Dequantise a GGUF checkpoint into a float32 HF folder under the cache, once.

    The folder appears atomically (written beside, then renamed), so an interrupted
    conversion never leaves a half-written model behind.
    """
    out = cache_dir() / "models" / f"{gguf.stem}-{gguf_key(gguf)}"
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        with _gguf_read_once():
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            quant = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # a model loaded from GGUF cannot be saved directly; rebuild it from its config
        config = quant.config
        if hasattr(config, "quantization_config"):  # the weights are dequantised: say so to every loader
            del config.quantization_config
        with torch.device("meta"):  # no random initialisation: every weight comes from the GGUF
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(quant.state_dict(), assign=True)
        model.tie_weights()
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.rename(tmp, out)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def gguf_key(gguf: Path, edge: int = 4 << 20) -> str:
    """What names a GGUF file's conversion: its size and the bytes of its first and last 4 MiB (the header,
    tensor table and the last tensors), not where it lies: a copy in a new environment finds the folder
    an earlier one converted (keyed by path and time, every fresh install converted again, 0.5 GB each)."""
    size = gguf.stat().st_size
    digest = hashlib.sha1(f"{CONVERSION}:{size}:".encode())
    with open(gguf, "rb") as f:
        digest.update(f.read(edge))
        f.seek(max(0, size - edge))
        digest.update(f.read(edge))
    return digest.hexdigest()[:12]


@contextlib.contextmanager
def _gguf_read_once() -> Iterator[None]:
    """transformers parses a GGUF file's metadata (the vocabulary among it) for the tokenizer, the
    config and the weights, three times, and builds gguf's table of tensor names once per module of
    the model (hundreds of times): about two thirds of a conversion. Within one, each file is parsed
    once and each table built once (gguf's reader and table are read-only)."""
    try:
        import gguf
    except ImportError:  # transformers says what to install
        yield
        return
    reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader, gguf.get_tensor_name_map = functools.cache(reader), functools.cache(names)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, names


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def end_token_ids(path: str, tokenizer) -> set[int]:
    """The ids that end a response: the model folder's generation_config (chat checkpoints list
    several, e.g. ``<|im_end|>`` and ``<|endoftext|>``), else the tokenizer's EOS."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    return set(eos if isinstance(eos, list) else [eos if eos is not None else tokenizer.eos_token_id])


def load_causal_lm(
    path: str,
    dtype: torch.dtype,
    device: torch.device,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    quantize: str = "none",
):
    """``path``'s causal LM in ``dtype`` on ``device``; ``attn_implementation``: model.attn_implementation;
    ``quantize``: its linear layers in 4 or 8 bits (model.lora.quantize), computing in ``dtype``."""
    from transformers import AutoModelForCausalLM

    from hybridrl.errors import ConfigError

    attention = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if quantize != "none":  # quantized as loaded, on the device that computes with them
        attention |= {"quantization_config": bits_config(quantize, dtype), "device_map": {"": device}}
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code, **attention
        )
    except (ValueError, ImportError) as e:
        if attention and "attn" in str(e).lower():
            raise ConfigError(
                f"model.attn_implementation '{attn_implementation}' cannot be used: {e} "
                "Leave it unset (transformers' sdpa; eager for a model whose attention soft-caps, as Gemma-2's)."
            ) from e
        raise _unloadable(path, e) from e
    except (OSError, KeyError, TypeError, AttributeError) as e:
        raise _unloadable(path, e) from e
    capped = soft_capped_attention(model.config)
    if capped and attn_implementation == "sdpa":
        raise ConfigError(
            f"model.attn_implementation '{attn_implementation}' would compute another model than {path}: its "
            f"attention soft-caps its scores (attn_logit_softcapping {capped:g}, Gemma-2), which transformers' "
            "SDPA attention leaves out, while vLLM and SGLang apply it. Leave model.attn_implementation unset "
            "(eager), or use flash_attention_2 or flex_attention, which apply it."
        )
    if capped and not attn_implementation:
        model.set_attn_implementation("eager")  # transformers' default, sdpa, leaves the soft-cap out
    pin_long_rope(model)
    if quantize == "none":
        return model.to(device)
    for module in model.modules():  # bitsandbytes repacks 4-bit weights for CPU inference, after which they
        if hasattr(module, "support_avx512bf16_for_cpu"):  # get no gradient: one layout for every pass
            module.support_avx512bf16_for_cpu = False
    return model


def bits_config(quantize: str, dtype: torch.dtype):
    """transformers' BitsAndBytesConfig for ``model.lora.quantize``: NF4 (QLoRA's) or 8-bit weights."""
    from hybridrl.errors import ConfigError

    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig
    except ImportError as e:
        raise ConfigError(
            f"model.lora.quantize '{quantize}' needs bitsandbytes ({e}). Install it with: pip install 'hybridrl[qlora]'"
        ) from e
    if quantize == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)


def check_quantized_base(options, engine, engine_name: str, sharding: str) -> None:
    """A quantized base (``model.lora.quantize``) trains where the engine samples from that same base:
    the adapters alone are synced (nothing merges into 4 or 8 bits), on one process. ``engine``: None
    before it is built (the config alone is checked)."""
    from hybridrl.errors import ConfigError

    said = f"model.lora.quantize is '{options.quantize}'"
    if options.sync == "merged":
        raise ConfigError(
            f"{said}, but model.lora.sync is 'merged': adapters cannot be merged into a quantized base without "
            "changing it. Set model.lora.sync: auto (the adapter alone)."
        )
    if sharding != "single":
        raise ConfigError(f"{said}: sharding.strategy '{sharding}' does not shard a quantized base; use single.")
    if engine is not None and not getattr(engine, "serves_quantized_base", False):
        raise ConfigError(
            f"{said}, but rollout engine '{engine_name}' would sample from the full-precision base, not the quantized "
            "one the policy trains over. Use rollout.engine: hf, which loads the same quantized base."
        )


def soft_capped_attention(config) -> float | None:
    """The cap of a model whose attention soft-caps its scores (Gemma-2: ``tanh(s / cap) * cap``), else None.

    transformers applies it in its eager, flex and flash attention, but its SDPA attention (the
    default since transformers 5) leaves it out: a Gemma-2 computed with SDPA differs from the
    checkpoint's own model, and from what vLLM and SGLang sample with (about 1e-3 a token, growing
    with the scores). Such models load with eager attention unless model.attn_implementation says
    otherwise."""
    return getattr(config.get_text_config(), "attn_logit_softcapping", None) or None


def load_model_config(path: str, trust_remote_code: bool = False):
    """``path``'s transformers config; a folder transformers cannot read is one ConfigError."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (ValueError, OSError, KeyError, TypeError, AttributeError) as e:
        raise _unloadable(path, e) from e


def parameter_count(config, trust_remote_code: bool = False, lora=None) -> tuple[int, int]:
    """The parameters of the causal LM of ``config`` (a transformers config), counted without weights, and
    of the LoRA adapters ``lora`` (LoraOptions) would put on its linear layers (r x (in + out) each) and
    a mixture's experts (bounded from above)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    adapters, output = 0, model.get_output_embeddings()
    targets = None if lora is None or lora.target_modules == "all-linear" else list(lora.target_modules)
    for name, m in model.named_modules() if lora is not None else ():
        linear = isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"  # GPT-2's, weights (in, out)
        chosen = m is not output if targets is None else any(name == t or name.endswith(f".{t}") for t in targets)
        adapters += lora.r * sum(m.weight.shape) if linear and chosen else 0
        experts = [w.shape for w in m.parameters(recurse=False) if w.dim() == 3] if chosen else []  # (E, out, in)
        adapters += sum(2 * lora.r * e * (a + b) for e, a, b in experts)  # at most what peft wraps them with
    return sum(p.numel() for p in model.parameters()), adapters


def check_context(config, prompt_tokens: int, max_tokens: int) -> None:
    """Prompts of up to ``prompt_tokens`` and ``max_tokens`` response tokens fit the model's context."""
    from hybridrl.errors import ConfigError

    context = getattr(config.get_text_config(), "max_position_embeddings", None)
    if context and prompt_tokens + max_tokens > context:
        raise ConfigError(
            f"rollout.max_tokens={max_tokens} beside prompts of up to {prompt_tokens} tokens does not fit the model's "
            f"context of {context} tokens (max_position_embeddings). Set rollout.max_tokens to at most "
            f"{max(1, context - prompt_tokens)}, or shorten the prompts (data.max_prompt_tokens)."
        )


def _unloadable(path: str, e: Exception):
    from hybridrl.errors import ConfigError

    reason = " ".join(str(e).split()) or type(e).__name__
    return ConfigError(
        f"model.path {path}: transformers cannot load this model ({type(e).__name__}: {reason}). Check its "
        "config.json against the model family's (a newer transformers may know it; trust_remote_code for "
        "models that ship their own code)."
    )


def compute_dtype(mixed_precision: str, dtype: torch.dtype, device: torch.device, option: str) -> torch.dtype | None:
    """The dtype trained models compute in under autocast (None: their float32 parameters').

    Trained models keep float32 master weights (:func:`master_weights`): with model.dtype bfloat16,
    an AdamW step of 1e-6 is far below half an ulp of a weight of 0.02 (about 4e-5) and no weight
    would ever move. So a 16-bit ``model.dtype`` is the compute dtype, and ``mixed_precision``
    (``option`` names it in errors): ``bf16`` computes in bfloat16; ``auto`` in a 16-bit model.dtype,
    else in bfloat16 on a CUDA GPU that has it, else float32; ``off`` in float32, refused with a
    16-bit model.dtype, whose weights would need float32 masters it would not use.
    """
    from hybridrl.errors import ConfigError

    low = dtype in LOW_PRECISION
    name = str(dtype).removeprefix("torch.")
    if mixed_precision == "off":
        if low:
            raise ConfigError(
                f"model.dtype {name} with {option}: off would train {name} weights with no float32 master copy: "
                f"an optimizer step below half a {name} ulp (lr 1e-6 on weights near 0.02) changes nothing. Set "
                f"{option}: auto (float32 master weights computed in {name}), or model.dtype: float32."
            )
        return None
    if mixed_precision == "bf16":
        return torch.bfloat16
    if low:
        return dtype
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def master_weights(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with float32 copies of its 16-bit trainable parameters (frozen ones, a LoRA model's
    base weights, keep their dtype)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and p.dtype in LOW_PRECISION:
                p.data = p.data.float()
    return model


def find_blocks(model: torch.nn.Module, names: list[str] | None = None) -> list[torch.nn.Module]:
    """The repeated blocks of a model, to shard one by one.

    ``names``: class names to look for; by default the model's ``_no_split_modules`` (what
    transformers itself keeps whole when it splits a model over devices). Without either, the
    entries of the model's largest ``ModuleList`` (``model.layers`` of most causal LMs).
    """
    wanted = set(names or getattr(model, "_no_split_modules", None) or [])
    if wanted:
        found = [m for m in model.modules() if type(m).__name__ in wanted and any(True for _ in m.parameters())]
        if found or names:
            return found
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        return []
    largest = max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters()))
    return list(largest)


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Zero every dropout of ``model``: its ``nn.Dropout`` modules and the attention-dropout
    probability that attention modules keep as a float (Llama, Qwen2...)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0
    return model


def enable_activation_checkpointing(model: torch.nn.Module, option: str) -> None:
    """The model's own gradient checkpointing, non-reentrant; a clear error where it has none."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing; set {option}=false.")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as generation uses them: (B, L) -> (B, L)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def is_checkpointing(model: torch.nn.Module) -> bool:
    """Whether activation checkpointing is on in ``model``: its recomputed layers cannot fill a KV cache."""
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
