"""Every model family, as its checkpoints ship, through the real trainer and the SGLang contract
engine (conftest.py: SGLang's in-process API over transformers, loading weights in the checkpoint's
format as SGLang's load_weights does): two GRPO steps with packed passes, the sync checked after each.

Not here: Phi-3's LongRoPE. SGLang picks the short or long factors for each forward batch (any
position past the original length: long), which no fake reproduces faithfully; the trainer pins
the set vLLM uses (hybridrl.models.pin_long_rope)."""

import json

import pytest

from hybridrl.config import load_config
from hybridrl.testing import SevensPlugin
from hybridrl.testing_models import ARCHITECTURES, build_checkpoint
from hybridrl.trainer import Trainer

CASES = [a for a in ARCHITECTURES if not a.startswith("phi3")]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("arch", CASES)
def test_two_grpo_steps_keep_sglang_and_trainer_equal(arch, lora, tmp_path, sglang_module, register_plugin):
    register_plugin(SevensPlugin(), name="sevens")
    model = build_checkpoint(tmp_path / arch, arch)
    cfg = {
        "model": {"path": model, **({"lora": {"r": 4, "alpha": 8, "target_modules": "all-linear"}} if lora else {})},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 16, "chat_template": True},
        "rollout": {"engine": "sglang", "n": 4, "max_tokens": 24, "sync_check_every": 1, "update_bucket_mb": 0.05},
        "rewards": [{"function": "sevens"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.01},
        "trainer": {"steps": 2, "prompts_per_step": 2, "lr": 1e-2, "seed": 0, "run_dir": str(tmp_path / "run")},
        "logging": {"loggers": ["jsonl"]},
    }
    cfg["trainer"]["pack_sequences"] = True
    Trainer(load_config(data=cfg)).train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert len(sglang_module.Engine.last.tensor_calls) >= 4  # buckets of whole layers, two syncs
    for r in rows:
        assert r["rollout/logprob_diff_max"] < 1e-4, (arch, r["step"], r["rollout/logprob_diff_max"])
        assert r["rollout/sync_check_diff_max"] < 1e-4
