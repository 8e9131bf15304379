"""Every model family, as its checkpoints ship, through the real trainer and the SGLang contract
engine (conftest.py: SGLang's in-process API over transformers, loading weights in the checkpoint's
format as SGLang's load_weights does): two GRPO steps with packed passes, the sync checked after each.

Not here: Phi-3's LongRoPE. SGLang picks the short or long factors for each forward batch (any
position past the original length: long), which no fake reproduces faithfully; the trainer pins
the set vLLM uses (hybridrl.models.pin_long_rope)."""

import pytest

from hybridrl.testing import SevensPlugin
from hybridrl.testing_models import ARCHITECTURES, build_checkpoint, two_grpo_steps

CASES = [a for a in ARCHITECTURES if not a.startswith("phi3")]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("arch", CASES)
def test_two_grpo_steps_keep_sglang_and_trainer_equal(arch, lora, tmp_path, sglang_module, register_plugin):
    register_plugin(SevensPlugin(), name="sevens")
    model = build_checkpoint(tmp_path / arch, arch)
    rows = two_grpo_steps(model, tmp_path / "run", "sglang", lora, update_bucket_mb=0.05)
    assert [r["step"] for r in rows] == [1, 2]
    assert len(sglang_module.Engine.last.tensor_calls) >= 4  # buckets of whole layers, two syncs
    for r in rows:
        assert r["rollout/logprob_diff_max"] < 1e-4, (arch, r["step"], r["rollout/logprob_diff_max"])
        assert r["rollout/sync_check_diff_max"] < 1e-4
