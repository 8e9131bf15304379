"""Every model family, as its checkpoints ship, through the real trainer and the SGLang contract
engine (conftest.py: SGLang's in-process API over transformers, loading weights in the checkpoint's
format as SGLang's load_weights does): two GRPO steps with packed passes, the sync checked after each.

Phi-3's LongRoPE: SGLang picks the short or long factors for each forward batch (long where a
position passes the original length), as the fake's transformers model does; the trainer takes the
set of the run's longest sequence (hybridrl.rope). Runs that cross the original length within a
response, whose batches SGLang computes with either set, are not covered."""

import json
from pathlib import Path

import pytest
from hybridrl_testing import SevensPlugin
from hybridrl_testing.models import ARCHITECTURES, build_checkpoint, two_grpo_steps

# every family full and with merged LoRA weights; the adapter alone through SGLang's LoRA where it serves one
MERGED_ONLY = ("qwen3_moe", "mixtral", "gpt2")
CASES = [(a, lo) for a in ARCHITECTURES for lo in (False, "merged")] + [
    (a, "adapter") for a in ARCHITECTURES if a not in MERGED_ONLY]  # fmt: skip


@pytest.mark.parametrize(("arch", "lora"), CASES, ids=[f"{a}-{lo or 'full'}" for a, lo in CASES])
def test_two_grpo_steps_keep_sglang_and_trainer_equal(arch, lora, tmp_path, sglang_module, register_plugin):
    register_plugin(SevensPlugin(), name="sevens")
    model = build_checkpoint(tmp_path / arch, arch)
    rows = two_grpo_steps(model, tmp_path / "run", "sglang", lora, update_bucket_mb=0.05)
    assert [r["step"] for r in rows] == [1, 2]
    engine = sglang_module.Engine.last
    if lora == "adapter":  # the adapter at setup and after each step, nothing else
        assert [c[0] for c in engine.core.calls].count("load_lora_adapter") == 3 and not engine.tensor_calls
    else:
        assert len(engine.tensor_calls) >= 4  # buckets of whole layers, two syncs
    for r in rows:
        assert r["rollout/logprob_diff_max"] < 1e-4, (arch, r["step"], r["rollout/logprob_diff_max"])
        assert r["rollout/sync_check_diff_max"] < 1e-4


@pytest.mark.parametrize("arch", ["phi3", "phi3-su"])
def test_longrope_within_the_original_length_trains_with_the_short_factors(
    arch, tmp_path, sglang_module, register_plugin
):
    """A checkpoint shaped like Phi-3.5's (original length 256 of 8,192) in a run whose sequences stay
    within the original length: SGLang computes every batch with the short factors, and so does the
    trainer (above, the tiny Phi-3's prompts pass its original 64: the long ones)."""
    register_plugin(SevensPlugin(), name="sevens")
    model = Path(build_checkpoint(tmp_path / arch, arch))
    cfg = json.loads((model / "config.json").read_text())
    cfg |= {"original_max_position_embeddings": 256, "max_position_embeddings": 8192}
    (model / "config.json").write_text(json.dumps(cfg))
    rows = two_grpo_steps(str(model), tmp_path / "run", "sglang")
    for r in rows:
        assert r["rollout/logprob_diff_max"] < 1e-4, (arch, r["step"], r["rollout/logprob_diff_max"])
        assert r["rollout/sync_check_diff_max"] < 1e-4
