"""model.lora.quantize: adapters trained in float32 over a 4-bit (NF4) or 8-bit base (bitsandbytes,
QLoRA), synced alone to the hf engine, which loads the same quantized base, so that its logprobs are
the trainer's; a resume is exact; what cannot serve or shard such a base stops the run at setup."""

import pytest
import torch
from hybridrl_testing import SevensPlugin, assert_same_metrics, metrics_rows

from hybridrl.builtin.rollout_hf import HFEngine
from hybridrl.config import ConfigError, load_config
from hybridrl.hookspecs import hookimpl
from hybridrl.run import build_run
from hybridrl.trainer import Trainer

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed: pip install 'hybridrl[qlora]'")
pytest.importorskip("peft", reason="peft is not installed: pip install 'hybridrl[lora]'")

LORA = {"r": 4, "alpha": 8, "target_modules": "all-linear", "quantize": "4bit"}


def config(model, run_dir, lora=None, **trainer):
    return {
        "model": {"path": model, "dtype": "float32", "lora": LORA | (lora or {})},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 32},
        "rollout": {"n": 4, "max_tokens": 12, "sync_check_every": 1},
        "rewards": [{"function": "sevens"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.05},
        "trainer": {"steps": 3, "prompts_per_step": 2, "lr": 1e-2, "seed": 0, "run_dir": str(run_dir), **trainer},
        "logging": {"loggers": ["jsonl"]},
    }


def lora_gradients(policy, ids, after_inference=False) -> torch.Tensor:
    if after_inference:
        with torch.no_grad():
            policy.eval()(ids)
    policy.train().zero_grad()
    policy(ids, labels=ids).loss.backward()
    grads = torch.cat([p.grad.flatten() for n, p in policy.named_parameters() if p.requires_grad])
    policy.zero_grad()
    return grads


def test_adapters_train_over_a_4bit_base_and_the_engine_samples_with_that_base(
    tiny_model, tmp_path, register_plugin, capsys
):
    register_plugin(SevensPlugin(), name="sevens")
    straight = tmp_path / "straight"
    trainer = Trainer(build_run(load_config(data=config(tiny_model, straight))))
    policy, engine = trainer.run.policy, trainer.run.engine
    quantized = [n for n, m in policy.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert quantized and all(".lora_" not in n for n, p in policy.named_parameters() if not p.requires_grad)
    assert all(p.dtype == torch.float32 for n, p in policy.named_parameters() if p.requires_grad)
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in engine.model.modules())  # the same base, quantized
    assert trainer.run.session.adapters  # on the CPU too: nothing merges into 4 bits
    assert "LoRA sync: the adapter alone" in capsys.readouterr().out
    # bitsandbytes repacks 4-bit weights at a CPU inference pass, after which no gradient flows through
    # them: the adapters' gradients are the same before and after one (the engine's copy never trains)
    ids = torch.randint(3, 60, (2, 16))
    assert torch.equal(lora_gradients(policy, ids), lora_gradients(policy, ids, after_inference=True))
    trainer.train()
    rows = metrics_rows(straight)
    # the engine's logprobs are the trainer's, over the same quantized base, before and after each sync
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in rows)
    assert all(r["rollout/sync_check_diff_max"] < 1e-4 for r in rows)
    assert rows[-1]["actor/kl"] > 0  # the reference is the quantized base, the adapters off

    resumed = tmp_path / "resumed"
    Trainer(build_run(load_config(data=config(tiny_model, resumed, steps=2)))).train()
    checkpoint = resumed / "checkpoints" / "step-000002" / "policy"
    assert (checkpoint / "adapter_config.json").is_file() and not (checkpoint / "model.safetensors").exists()
    Trainer(build_run(load_config(data=config(tiny_model, resumed, steps=3, resume=True)))).train()
    assert_same_metrics(metrics_rows(resumed), rows)


@pytest.mark.parametrize(
    "case",
    [
        ({"sync": "merged"}, {}, "cannot be merged into a quantized base"),
        ({}, {"sharding": {"strategy": "fsdp"}}, "does not shard a quantized base; use single"),
        ({}, {"rollout": {"engine": "plain", "n": 4, "max_tokens": 12}}, "would sample from the full-precision base"),
    ],
)
def test_what_cannot_serve_or_shard_a_quantized_base_stops_at_setup(case, tiny_model, tmp_path, register_plugin):
    class Plain(HFEngine):  # an engine that loads the base as it was saved (vLLM's, SGLang's)
        serves_quantized_base = False

    class Plugin:
        @hookimpl
        def register_rollout_engines(self, register):
            register("plain", Plain)

    register_plugin(Plugin(), name="plain")
    register_plugin(SevensPlugin(), name="sevens")
    lora, sections, message = case
    data = config(tiny_model, tmp_path / "run", lora) | sections
    with pytest.raises(ConfigError, match=message):
        build_run(load_config(data=data))
