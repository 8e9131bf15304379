"""Sharding strategy ``single``: mixed precision, activation checkpointing and compiled blocks
change how the passes run, not what they compute (beyond bf16 rounding)."""

import pytest
import torch

from hybridrl import plugins
from hybridrl.components import RunContext
from hybridrl.forward import ModelHandle
from hybridrl.models import load_causal_lm, load_tokenizer
from hybridrl.passes import response_logprobs


def strategy(tiny_model, tmp_path, **options):
    cls = plugins.lookup("sharding strategy", "single")
    ctx = RunContext(tiny_model, load_tokenizer(tiny_model), torch.device("cpu"), torch.float32, 0, tmp_path)
    return cls(cls.Options(**options), ctx)


def loss_and_grads(model, strategy):
    """``model`` (or its handle) under ``strategy``'s autocast: logprobs and gradients of a pass."""
    handle = model if isinstance(model, ModelHandle) else ModelHandle(model)
    model = handle.model
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (4, 12), generator=g)
    mask = torch.ones_like(ids)
    model.zero_grad()
    with strategy.autocast():
        lp, _ = response_logprobs(handle, ids, mask, 6)
    lp.sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_mixed_precision_auto_is_off_on_cpu_and_bf16_runs_in_bfloat16(tiny_model, tmp_path):
    assert strategy(tiny_model, tmp_path).compute_dtype is None  # auto: only on a CUDA GPU
    bf16 = strategy(tiny_model, tmp_path, mixed_precision="bf16")
    model = bf16.wrap(load_causal_lm(tiny_model, torch.float32, torch.device("cpu")))
    lp32, g32 = loss_and_grads(model, strategy(tiny_model, tmp_path))
    lp16, g16 = loss_and_grads(model, bf16)
    # bfloat16 matmuls: close to float32, but not the same numbers; parameters and gradients stay float32
    assert 0 < (lp16 - lp32).abs().max() < 0.05
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    rel = max(((g16[n] - g32[n]).norm() / g32[n].norm().clamp(min=1e-12)).item() for n in g32)
    assert rel < 0.05


def test_activation_checkpointing_gives_the_same_gradients(tiny_model, tmp_path):
    plain = strategy(tiny_model, tmp_path)
    model = plain.wrap(load_causal_lm(tiny_model, torch.float32, torch.device("cpu")))
    lp, grads = loss_and_grads(model, plain)
    ckpt = strategy(tiny_model, tmp_path, activation_checkpointing=True)
    model2 = ckpt.wrap(load_causal_lm(tiny_model, torch.float32, torch.device("cpu")))
    assert model2.is_gradient_checkpointing
    lp2, grads2 = loss_and_grads(model2.train(), ckpt)
    assert torch.allclose(lp, lp2, atol=1e-6)
    for n in grads:
        assert torch.allclose(grads[n], grads2[n], rtol=1e-5, atol=1e-7), n


def test_unknown_mixed_precision_lists_the_choices(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="'auto', 'off' or 'bf16'"):
        strategy(tiny_model, tmp_path, mixed_precision="fp8")


def test_compiled_blocks_give_the_same_logprobs_and_gradients(tiny_model, tmp_path, monkeypatch):
    import torch._inductor.config as inductor

    plain = strategy(tiny_model, tmp_path)
    lp, grads = loss_and_grads(plain.wrap(load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))), plain)
    compiled = strategy(tiny_model, tmp_path, compile=True)
    monkeypatch.setattr(inductor.triton, "mix_order_reduction_non_strict_mode", False)
    model = compiled.wrap(load_causal_lm(tiny_model, torch.float32, torch.device("cpu")))
    assert all("forward" in vars(b) for b in model.model.layers)  # each block's forward compiled
    # one graph for passes of every size: inductor's mix-order reduction (GPU kernels) tests the size of a
    # pass otherwise, a guard that recompiled the blocks at step 2 of an H200 run (BENCHMARKS.md)
    assert inductor.triton.mix_order_reduction_non_strict_mode is True
    assert compiled.fused_head_bytes == 8 * 2**30  # the output layer's compiled chunk, keep_logits_gib 8
    handle = ModelHandle(model, compiled.fused_head_bytes)  # as the pass runner makes it
    torch._dynamo.reset()  # no compiled code of earlier tests to reuse (the counters run on)
    graphs = torch._dynamo.utils.counters["stats"]
    before = graphs["unique_graphs"]
    assert handle.head_split() is not None
    assert graphs["unique_graphs"] == before  # its probe compiled nothing
    lp2, grads2 = loss_and_grads(handle, compiled)
    assert graphs["unique_graphs"] > before  # the passes did
    assert torch.allclose(lp, lp2, atol=1e-5)
    for n in grads:
        assert torch.allclose(grads[n], grads2[n], rtol=1e-4, atol=1e-6), n


def test_a_pass_that_shares_prompts_runs_the_compiled_blocks_eagerly_and_compiles_nothing(tiny_model, tmp_path):
    """Rows with the same prompt: the pass runs the prompt once, keeping its keys and values in a cache
    the responses read. Blocks called with that cache run eagerly; compiled, its per-layer state made a
    graph for each layer and state (64 for SmolLM2 on a CPU, when torch stopped compiling)."""
    plain = strategy(tiny_model, tmp_path)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 100, (2, 6), generator=g).repeat_interleave(2, 0)  # two prompts, two rows each
    ids = torch.cat([prompts, torch.randint(3, 100, (4, 5), generator=g)], 1)
    mask = torch.ones_like(ids)
    lp, _ = response_logprobs(plain.wrap(load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))), ids, mask, 5)
    compiled = strategy(tiny_model, tmp_path, compile=True)
    model = compiled.wrap(load_causal_lm(tiny_model, torch.float32, torch.device("cpu")))
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]
    before = graphs["unique_graphs"]
    with torch.no_grad():
        shared, _ = response_logprobs(model, ids, mask, 5, share_prompts=True)
    assert graphs["unique_graphs"] == before  # nothing compiled for the cache's layers
    assert torch.allclose(shared, lp, atol=1e-5)


def bf16_run(model, run_dir, **sharding):
    from hybridrl.config import load_config

    return load_config(
        data={
            "model": {"path": model, "dtype": "bfloat16"},
            "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 16},
            "rollout": {"n": 4, "max_tokens": 8},
            "rewards": [{"function": "format", "pattern": "7"}],
            "algorithm": {"name": "grpo", "kl_coef": 0.01},
            "sharding": {"strategy": "single", **sharding},
            "trainer": {"steps": 1, "prompts_per_step": 2, "lr": 1e-6, "run_dir": str(run_dir)},
            "logging": {"loggers": []},
        }
    )


def test_bfloat16_policy_trains_on_float32_master_weights(tiny_model, tmp_path, register_plugin):
    """model.dtype bfloat16: an AdamW step of 1e-6 is far below half a bfloat16 ulp at |w| = 0.02
    (about 4e-5), so bfloat16 weights would not move; the policy keeps float32 master weights and
    computes in bfloat16, and one step moves nearly all of them."""
    from hybridrl.hookspecs import hookimpl
    from hybridrl.run import build_run
    from hybridrl.trainer import Trainer

    class Snapshot:
        @hookimpl
        def on_train_start(self, run):
            self.before = {n: p.detach().clone() for n, p in run.policy.named_parameters()}
            self.compute_dtype = run.strategy.compute_dtype
            self.ref_dtype = next(run.ref.parameters()).dtype

    snap = register_plugin(Snapshot(), name="snapshot")
    trainer = Trainer(build_run(bf16_run(tiny_model, tmp_path / "run")))
    trainer.train()
    assert all(p.dtype == torch.float32 for p in snap.before.values())
    assert snap.compute_dtype == torch.bfloat16
    assert snap.ref_dtype == torch.bfloat16  # frozen copies keep model.dtype
    changed = sum(int((p.detach() != snap.before[n]).sum()) for n, p in trainer.run.policy.named_parameters())
    assert changed / sum(p.numel() for p in snap.before.values()) > 0.9


def test_bfloat16_without_autocast_is_refused_before_the_model_loads(tiny_model, tmp_path, monkeypatch):
    from hybridrl import run as run_module
    from hybridrl.config import ConfigError

    monkeypatch.setattr(run_module, "load_causal_lm", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(ConfigError, match="mixed_precision: off.*no float32 master copy.*mixed_precision: auto"):
        run_module.build_run(bf16_run(tiny_model, tmp_path / "run", mixed_precision="off"))


@pytest.mark.parametrize(
    "device, steps, want",
    [
        ("cpu", None, False),  # compiling the passes pays on a GPU only
        ("cuda", None, True),  # no planned end
        ("cuda", 1000, True),  # 1000 x 32 x (100 + 256) = 11.4M tokens
        ("cuda", 300, False),  # 3.4M tokens: under the 4M that pay back ~30 s of compiling
    ],
)
def test_compile_auto_compiles_on_a_gpu_when_the_run_trains_enough_tokens(
    tiny_model, tmp_path, capsys, monkeypatch, device, steps, want
):
    import dataclasses

    from hybridrl import compile as compile_module
    from hybridrl.builtin.sharding_single import COMPILE_PAYS_TOKENS, compiles

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))  # cold, and nothing left behind
    monkeypatch.setattr(compile_module, "_pending", {})

    ctx = RunContext(tiny_model, None, torch.device(device), torch.float32, 0, tmp_path)
    ctx = dataclasses.replace(ctx, steps=steps, responses_per_call=32, prompt_tokens=100, response_tokens=256)
    assert compiles("auto", ctx) is want
    said = capsys.readouterr().out
    assert ("compile auto: off" in said) is (device == "cuda" and not want)  # said once, with the way out
    assert ("sharding.compile: on" in said) is (device == "cuda" and not want)
    assert ("sharding.compile auto: on, as the run" in said) is (device == "cuda" and want)  # and when it compiles
    assert compiles("on", ctx) and not compiles("off", ctx)
    assert 300 * 32 * 356 < COMPILE_PAYS_TOKENS < 1000 * 32 * 356


def test_compile_auto_compiles_shorter_runs_once_the_compile_cache_holds_the_model(
    tiny_model, tmp_path, capsys, monkeypatch
):
    """A first step that compiled marks the compile cache warm for the run's model shape, dtype, GPU and
    torch; a later run of the same pays back compiling after WARM_SHARE of the tokens, another does not."""
    import dataclasses
    import json
    import shutil

    from hybridrl import compile as compile_module
    from hybridrl.builtin.sharding_single import COMPILE_PAYS_TOKENS, compiles

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(compile_module, "_pending", {})
    ctx = RunContext(tiny_model, None, torch.device("cuda"), torch.float32, 0, tmp_path)
    # 300 x 32 x (100 + 256) = 3.4M tokens: under the 4M that pay back a cold compile, over 0.3 of them
    short = dataclasses.replace(ctx, steps=300, responses_per_call=32, prompt_tokens=100, response_tokens=256)
    assert 300 * 32 * 356 < COMPILE_PAYS_TOKENS and 300 * 32 * 356 > compile_module.WARM_SHARE * COMPILE_PAYS_TOKENS
    assert not compiles("auto", short)
    assert compiles("auto", dataclasses.replace(short, steps=None))  # a run without end compiles
    monkeypatch.setattr(compile_module, "compile_seconds", lambda: 0.0)
    compile_module.remember_compiled()  # its first step compiled nothing: nothing is marked
    assert not compiles("auto", short)
    assert compiles("on", short)
    monkeypatch.setattr(compile_module, "compile_seconds", lambda: 31.5)
    compile_module.use_cache("auto")  # another run starts before this one's first step: nothing is marked
    compile_module.remember_compiled()
    assert not (tmp_path / "cache" / "hybridrl-compiled").exists()
    assert compiles("on", short)
    compile_module.remember_compiled()
    (marker,) = (tmp_path / "cache" / "hybridrl-compiled").iterdir()
    assert json.loads(marker.read_text())["option"] == "sharding.compile"
    capsys.readouterr()
    assert compiles("auto", short)
    said = capsys.readouterr().out
    assert "sharding.compile auto: on" in said and "holds what an earlier run of this model compiled" in said
    assert not compiles("auto", dataclasses.replace(short, steps=100))  # 1.1M tokens: under 0.3 x 4M
    assert not compiles("auto", dataclasses.replace(short, dtype=torch.bfloat16))
    other = tmp_path / "other"
    shutil.copytree(tiny_model, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 3}))
    assert not compiles("auto", dataclasses.replace(short, model_path=str(other)))
    monkeypatch.setattr(torch, "__version__", "9.9.0")
    assert not compiles("auto", short)


def test_compiled_strategy_keeps_packed_rows_one_width_and_at_least_two(tiny_model, tmp_path):
    """With compiled blocks every packed pass has the run's width and two rows or more, so that one
    graph (rows dynamic) serves them all; without, each batch's own width, packed only where that
    saves tokens."""
    import dataclasses

    from hybridrl_testing import fixed_batch

    from hybridrl.memory import MicroBatches
    from hybridrl.passes import Planner

    cls = plugins.lookup("sharding strategy", "single")
    ctx = RunContext(tiny_model, load_tokenizer(tiny_model), torch.device("cpu"), torch.float32, 0, tmp_path)
    ctx = dataclasses.replace(ctx, prompt_tokens=300, response_tokens=200)
    assert cls(cls.Options(compile="on"), ctx).pack_width == 512
    assert cls(cls.Options(compile="off"), ctx).pack_width is None
    batch = fixed_batch(ctx.tokenizer, [[3, 5]])  # two short sequences: one packed row of their own
    handle = ModelHandle(load_causal_lm(tiny_model, torch.float32, torch.device("cpu")))
    (p,) = Planner(pack_sequences=True, width=512).plan(handle, batch)
    assert p.layout == "packed" and (p.placement.width, p.placement.rows) == (512, 2)
    for budget, rows in ((1024, 2), (1000, 1)):  # two rows only where the token budget of a pass holds them
        (p,) = Planner(pack_sequences=True, width=512, budget=MicroBatches(None, budget, None, None, ctx.device)).plan(
            handle, batch
        )
        assert p.layout == "packed" and (p.placement.width, p.placement.rows) == (512, rows)
    (p,) = Planner(pack_sequences=True).plan(handle, batch)  # one row of 128 holds more than the padded pass
    assert p.layout == "padded"


@pytest.mark.parametrize("cudnn", [False, True])
def test_cudnn_attention_is_off_unless_asked_for(tiny_model, tmp_path, cudnn):
    """trainer.cudnn_attention (default off): PyTorch's attention may not pick cuDNN's kernels, which
    plan every new batch shape at its first pass (a stall each time a step's lengths make a new row
    count); the setting is the process's, made when the run is built."""
    from hybridrl.run import build_run

    config = bf16_run(tiny_model, tmp_path / "run")
    config.trainer.cudnn_attention = cudnn
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(not cudnn)
    try:
        build_run(config).close()
        assert torch.backends.cuda.cudnn_sdp_enabled() == cudnn
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
