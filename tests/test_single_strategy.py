"""Sharding strategy ``single``: mixed precision, activation checkpointing and compiled blocks
change how the passes run, not what they compute (beyond bf16 rounding)."""

import pytest
import torch

from hybridrl import plugins
from hybridrl.components import RunContext
from hybridrl.models import load_causal_lm, load_tokenizer, response_logprobs


def strategy(tiny_model, tmp_path, **options):
    cls = plugins.lookup("sharding strategy", "single")
    ctx = RunContext(tiny_model, load_tokenizer(tiny_model), torch.device("cpu"), torch.float32, 0, tmp_path)
    return cls(cls.Options(**options), ctx)


def loss_and_grads(model, strategy):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (4, 12), generator=g)
    mask = torch.ones_like(ids)
    model.zero_grad()
    with strategy.autocast():
        lp, _ = response_logprobs(model, ids, mask, 6)
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


def test_compiled_blocks_give_the_same_logprobs_and_gradients(tiny_model, tmp_path):
    plain = strategy(tiny_model, tmp_path)
    lp, grads = loss_and_grads(plain.wrap(load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))), plain)
    compiled = strategy(tiny_model, tmp_path, compile=True)
    model = compiled.wrap(load_causal_lm(tiny_model, torch.float32, torch.device("cpu")))
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in model.model.layers)
    assert model._hybridrl_fused_head == 8 * 2**30  # the output layer's compiled chunk, keep_logits_gib 8
    lp2, grads2 = loss_and_grads(model, compiled)
    assert torch.allclose(lp, lp2, atol=1e-5)
    for n in grads:
        assert torch.allclose(grads[n], grads2[n], rtol=1e-4, atol=1e-6), n
