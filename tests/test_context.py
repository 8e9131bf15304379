"""The run's one context: built once, completed in place by the builder, the same object in every
component; and what it tells an engine about training's memory."""

import pytest
import torch
from hybridrl_testing import SevensPlugin
from hybridrl_testing.models import ARCHITECTURES, MOE, build_checkpoint

from hybridrl.components import RunContext, TrainingMemory
from hybridrl.config import load_config
from hybridrl.models import load_causal_lm, load_model_config, parameter_count
from hybridrl.run import build_run


def test_join_sets_a_field_once(tmp_path):
    ctx = RunContext("", None, torch.device("cpu"), torch.float32, 0, tmp_path)
    ctx.join(prompt_tokens=12)
    assert ctx.prompt_tokens == 12
    with pytest.raises(RuntimeError, match="prompt_tokens is set once"):
        ctx.join(prompt_tokens=13)
    with pytest.raises(AttributeError):  # frozen for everyone else
        ctx.seed = 1


def test_every_component_holds_the_one_context(tiny_model, tmp_path, register_plugin):
    register_plugin(SevensPlugin(), name="sevens")
    cfg = load_config(
        data={
            "model": {"path": tiny_model},
            "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 16},
            "rollout": {"engine": "hf", "n": 2, "max_tokens": 4},
            "rewards": [{"function": "sevens"}],
            "trainer": {"steps": 1, "prompts_per_step": 2, "run_dir": str(tmp_path / "run")},
            "logging": {"loggers": ["jsonl"]},
        }
    )
    run = build_run(cfg)
    try:
        parts = [run.data, run.strategy, run.algorithm, run.engine, *run.loggers]
        parts += [fn for _, fn in run.rewards.pairs]
        assert all(p.ctx is run.ctx for p in parts), [type(p).__name__ for p in parts if p.ctx is not run.ctx]
        # what the builder learned joined that one object: the data's longest prompt, the services
        assert run.ctx.prompt_tokens and run.ctx.strategy is run.strategy and run.ctx.passes is run.passes
        assert run.ctx.training_memory is None  # on the CPU no engine shares a GPU with training
    finally:
        run.close()


def test_training_memory_counts_the_policy(tiny_model):
    config = load_model_config(tiny_model, False)
    model = load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))
    n = sum(p.numel() for p in model.parameters())
    assert parameter_count(config) == (n, 0)
    memory = TrainingMemory.of(n, world_size=2)
    assert (memory.parameters, memory.between_updates, memory.during_update) == (n, n * 6, n * 8)


@pytest.mark.parametrize(
    "arch, targets",
    [(arch, "all-linear") for arch in ARCHITECTURES if arch != "phi3-su"]  # phi3's layers
    + [("llama", ["q_proj", "mlp.down_proj"]), ("gpt2", ["c_attn"])],
)
def test_training_memory_under_lora_counts_a_frozen_base_and_the_adapters(tmp_path, arch, targets):
    """LoRA trains its adapters alone: AdamW's state is theirs, the base is kept frozen (float32, or in
    bits), and the adapters are counted as peft makes them, on the meta device, for every family: on
    linear layers and GPT-2's Conv1D, by name or a dotted path's end, never on the output layer."""
    from peft import LoraConfig, get_peft_model

    from hybridrl.config_sections import LoraOptions

    path = build_checkpoint(tmp_path / arch, arch)
    config = load_model_config(path, False)
    model = load_causal_lm(path, torch.float32, torch.device("cpu"))
    n = sum(p.numel() for p in model.parameters())
    peft = get_peft_model(model, LoraConfig(r=8, target_modules=targets))
    adapters = sum(p.numel() for name, p in peft.named_parameters() if "lora_" in name)
    counted, estimate = parameter_count(config, lora=LoraOptions(r=8, target_modules=targets))
    if arch in MOE:  # peft wraps the experts' 3-D weights its own way: the estimate bounds it from above
        assert counted == n and adapters < estimate < 1.3 * adapters
    else:
        assert adapters > 0 and (counted, estimate) == (n, adapters)
    memory = TrainingMemory.of(n, 1, adapters, frozen_bytes=4)
    assert (memory.parameters, memory.trained) == (n + adapters, adapters)
    assert memory.between_updates == adapters * 12 + n * 4
    assert memory.during_update == adapters * 16 + n * 4


def test_the_loop_takes_a_run_and_says_so(tiny_model):
    from hybridrl.trainer import Trainer

    data = {"source": "reasoning_gym", "task": "chain_sum", "size": 4}
    cfg = load_config(data={"model": {"path": tiny_model}, "data": data, "rewards": [{"function": "reasoning_gym"}]})
    with pytest.raises(TypeError, match=r"Trainer takes a Run, not RunConfig: Trainer\(build_run\(config\)\)"):
        Trainer(cfg)
