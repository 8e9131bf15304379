"""LoRA (model.lora, through peft): adapters only in the optimizer, the reference is the base with the
adapters off, engines follow the merged weights, checkpoints resume exactly, export (merged too)."""

import json

import pytest
import torch

from hybridrl import lora
from hybridrl.config import ConfigError, load_config
from hybridrl.hookspecs import hookimpl
from hybridrl.models import load_causal_lm, response_logprobs
from hybridrl.testing import SevensPlugin, fixed_batch, hf_greedy, policy_greedy
from hybridrl.trainer import Trainer

pytest.importorskip("peft", reason="peft is not installed: pip install 'hybridrl[lora]'")

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}


def config(model, run_dir, **trainer):
    return {
        "model": {"path": model, "lora": LORA},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 32},
        "rollout": {"n": 4, "max_tokens": 12},
        "rewards": [{"function": "sevens"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.05},
        "trainer": {"steps": 2, "prompts_per_step": 2, "lr": 1e-2, "seed": 0, "run_dir": str(run_dir), **trainer},
        "logging": {"loggers": ["jsonl"]},
    }


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_only_adapters_train_and_the_reference_is_the_base(tiny_model, tmp_path, register_plugin):
    register_plugin(SevensPlugin(), name="sevens")
    t = Trainer(load_config(data=config(tiny_model, tmp_path / "run")))
    t.setup()
    trained = [n for n, p in t.policy.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n for n in trained)
    in_optimizer = sum(p.numel() for g in t.optimizer.param_groups for p in g["params"])
    assert in_optimizer == sum(p.numel() for n, p in t.policy.named_parameters() if p.requires_grad)
    assert t.ref is None  # no second copy of the model
    with torch.no_grad():  # make the adapters do something, then check the reference ignores them
        for n, p in t.policy.named_parameters():
            if "lora_B" in n:
                p.normal_()
    batch = fixed_batch(t.tokenizer, [[3, 5], [4, 2]])
    t.compute_logprobs(batch)
    base = load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        want, _ = response_logprobs(base, batch.input_ids, batch.attention_mask, batch["responses"].shape[1])
        with_adapters, _ = response_logprobs(t.policy, batch.input_ids, batch.attention_mask, 5)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(batch["ref_logprobs"][mask], want[mask], atol=1e-5, rtol=1e-5)
    assert (with_adapters[mask] - want[mask]).abs().max() > 1e-2


def test_merged_weights_are_the_base_plus_the_adapters(tiny_model):
    from peft import get_peft_model  # noqa: F401 - the check below uses peft's own merge as the reference

    from hybridrl.config import LoraOptions

    model = lora.apply_lora(load_causal_lm(tiny_model, torch.float32, torch.device("cpu")), LoraOptions(**LORA))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    merged = dict(lora.merged_tensors(model.state_dict().items(), lora.scalings(model)))
    want = model.merge_and_unload().state_dict()
    assert merged.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(merged[key], want[key], msg=key)


class EngineFollows:
    """At the end of training: the engine's greedy output is the merged policy's."""

    @hookimpl
    def on_train_end(self, trainer):
        prompts = [[5, 6, 7], [9, 10, 11, 12]]
        self.want = policy_greedy(trainer, prompts, 8)
        engine = trainer.engine.model  # the hf engine's own copy
        self.got = hf_greedy(engine, prompts, 8)


def test_the_engine_follows_the_adapters_and_a_resume_is_exact(tiny_model, tmp_path, register_plugin):
    register_plugin(SevensPlugin(), name="sevens")
    check = register_plugin(EngineFollows(), name="follows")
    straight = tmp_path / "straight"
    Trainer(load_config(data=config(tiny_model, straight, steps=3))).train()
    assert check.got == check.want
    rows = metrics(straight)
    assert rows[-1]["rollout/logprob_diff_max"] < 1e-4  # the engine sampled with the trained adapters

    resumed = tmp_path / "resumed"
    Trainer(load_config(data=config(tiny_model, resumed, steps=2))).train()
    checkpoint = resumed / "checkpoints" / "step-000002" / "policy"
    assert (checkpoint / "adapter_config.json").is_file() and not (checkpoint / "model.safetensors").exists()
    Trainer(load_config(data=config(tiny_model, resumed, steps=3, resume=True))).train()
    for got, want in zip(metrics(resumed), rows, strict=True):
        for key in want:
            if not key.startswith(("timing/", "throughput/", "time")):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (got["step"], key)


def test_export_writes_the_adapter_and_with_merged_the_whole_model(tiny_model, tmp_path, register_plugin):
    from transformers import AutoModelForCausalLM

    from hybridrl.checkpoint import export

    register_plugin(SevensPlugin(), name="sevens")
    trainer = Trainer(load_config(data=config(tiny_model, tmp_path / "run")))
    trainer.train()
    step = tmp_path / "run" / "checkpoints" / "step-000002"
    adapter = export(step, tmp_path / "adapter")
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    full = export(step, tmp_path / "merged", merged=True)
    model = AutoModelForCausalLM.from_pretrained(full).state_dict()
    want = dict(trainer.policy_tensors())
    for key, value in model.items():
        torch.testing.assert_close(value, want[key], atol=1e-6, rtol=1e-5, msg=key)


def test_target_modules_that_match_nothing_list_the_layers(tiny_model, tmp_path, register_plugin):
    register_plugin(SevensPlugin(), name="sevens")
    data = config(tiny_model, tmp_path / "run")
    data["model"]["lora"] = {"target_modules": ["query", "value"]}
    with pytest.raises(ConfigError, match=r"match no layer of LlamaForCausalLM. Its linear layers are named: .*q_proj"):
        Trainer(load_config(data=data)).setup()
