"""Response logprobs: padding columns cut, output layer in checkpointed chunks, same numbers and
gradients as the textbook computation from full logits."""

import pytest
import torch
from hybridrl_testing import embedded_tokens, small_model

from hybridrl.forward import ModelHandle, chunked_head_logprobs, head_split
from hybridrl.models import disable_dropout, load_causal_lm
from hybridrl.passes import response_logprobs


def reference(model, ids, mask, T, temperature=1.0):
    """log_softmax over the full logits of every position, no cutting, no chunks."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    logits = logits[:, -T - 1 : -1].float() / temperature
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, ids[:, -T:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def padded_batch(vocab: int):
    """Prompts left-padded (at least 2 pad columns in every row), responses right-padded (the
    last 3 columns padding in every row): P = 7, T = 9."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (3, 16), generator=g)
    mask = torch.ones_like(ids)
    for row, (lead, resp) in enumerate([(2, 6), (4, 5), (3, 2)]):
        mask[row, :lead] = 0
        mask[row, 7 + resp :] = 0
    ids[mask == 0] = 0
    return ids, mask


@pytest.fixture(scope="module")
def model(tiny_model):
    torch.manual_seed(0)
    m = load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))
    with torch.no_grad():  # random init is near-uniform; sharpen so entropies and logprobs vary
        m.get_output_embeddings().weight.mul_(40)
    return m


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_the_full_logits_computation(model, temperature):
    assert head_split(model) is not None  # the chunked path is the one under test
    ids, mask = padded_batch(model.config.vocab_size)
    T = 9
    resp = mask[:, -T:].bool()

    want_lp, want_ent = reference(model, ids, mask, T, temperature)
    model.zero_grad()
    (want_lp[resp].sum() + want_ent[resp].sum()).backward()
    want_grad = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    lp, ent = response_logprobs(model, ids, mask, T, temperature, with_entropy=True, entropy_grad=True)
    (lp[resp].sum() + ent[resp].sum()).backward()

    assert lp.shape == ent.shape == (3, T)
    assert (lp[resp] - want_lp[resp]).abs().max() < 1e-5
    assert (ent[resp] - want_ent[resp]).abs().max() < 1e-5
    assert (lp[:, -3:] == 0).all() and (ent[:, -3:] == 0).all()  # cut columns come back as zeros
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, want_grad[name], rtol=1e-4, atol=1e-6), name


def test_entropy_without_grad_leaves_gradients_to_the_logprobs(model):
    ids, mask = padded_batch(model.config.vocab_size)
    resp = mask[:, -9:].bool()
    lp, ent = response_logprobs(model, ids, mask, 9, with_entropy=True, entropy_grad=False)
    assert lp.requires_grad and not ent.requires_grad
    want_lp, want_ent = reference(model, ids, mask, 9)
    assert (ent[resp] - want_ent[resp]).abs().max() < 1e-5


def test_chunks_of_one_token_give_the_same_values_and_gradients(model):
    ids, _ = padded_batch(model.config.vocab_size)
    hidden = torch.randn(2, 5, model.config.hidden_size, requires_grad=True)
    tokens = ids[:2, :5]
    head = model.get_output_embeddings()
    one_chunk = chunked_head_logprobs(hidden, head, tokens, with_entropy=True, entropy_grad=True)
    g1 = torch.autograd.grad(sum(t.sum() for t in one_chunk), hidden)[0]
    # a float32 row of logits is 4 * V bytes: this budget holds one token per chunk
    per_token = chunked_head_logprobs(hidden, head, tokens, with_entropy=True, entropy_grad=True, chunk_bytes=1)
    g2 = torch.autograd.grad(sum(t.sum() for t in per_token), hidden)[0]
    for a, b in zip(one_chunk, per_token):
        assert torch.allclose(a, b, atol=1e-6)
    assert torch.allclose(g1, g2, rtol=1e-5, atol=1e-5)


def test_models_that_transform_their_logits_use_the_plain_path():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, final_logit_softcapping=0.05, pad_token_id=0,
    )  # fmt: skip
    model = Gemma2ForCausalLM(cfg)
    assert head_split(model) is None  # tanh soft-capping after the output layer
    ids, mask = padded_batch(64)
    resp = mask[:, -9:].bool()
    with torch.no_grad():
        lp, _ = response_logprobs(model, ids, mask, 9)
        want, _ = reference(model, ids, mask, 9)
    assert (lp[resp] - want[resp]).abs().max() < 1e-5


def test_batches_without_response_tokens_keep_their_shape_and_graph(model):
    ids, mask = padded_batch(model.config.vocab_size)
    mask[:, -9:] = 0  # every response empty
    lp, ent = response_logprobs(model, ids, mask, 9, with_entropy=True)
    assert lp.shape == ent.shape == (3, 9) and not lp[:, 1:].any() and lp.requires_grad
    lp, _ = response_logprobs(model, ids[:, :7], mask[:, :7], 0)
    assert lp.shape == (3, 0) and lp.requires_grad


@pytest.mark.parametrize("arch", ["qwen2", "llama", "phi3", "gemma", "gpt2"])
def test_every_architecture_takes_the_chunked_path_with_the_same_values_and_gradients(arch):
    model = disable_dropout(small_model(arch))  # GPT-2 has dropout 0.1: training passes would differ
    assert head_split(model) is not None  # plain logits = output layer of the body's last hidden state
    ids, mask = padded_batch(64)
    resp = mask[:, -9:].bool()
    want, _ = reference(model, ids, mask, 9)
    model.zero_grad()
    want[resp].sum().backward()
    want_grad = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    lp, _ = response_logprobs(model, ids, mask, 9)
    lp[resp].sum().backward()
    assert (lp[resp] - want[resp]).abs().max() < 1e-5
    for n, p in model.named_parameters():  # relative to the tensor's largest gradient
        assert (p.grad - want_grad[n]).abs().max() <= 1e-5 * want_grad[n].abs().max(), n


def test_disable_dropout_makes_training_passes_deterministic():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    gpt2 = small_model("gpt2").train()  # dropout modules (p = 0.1)
    ids = torch.randint(3, 64, (2, 8))
    assert not torch.equal(gpt2(input_ids=ids).logits, gpt2(input_ids=ids).logits)
    disable_dropout(gpt2)
    assert torch.equal(gpt2(input_ids=ids).logits, gpt2(input_ids=ids).logits)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.5)  # fmt: skip
    qwen = disable_dropout(Qwen2ForCausalLM(cfg))  # attention dropout kept as a float by the attention module
    assert all(m.attention_dropout == 0.0 for m in qwen.modules() if hasattr(m, "attention_dropout"))


@pytest.mark.parametrize("keep", [False, True])
def test_the_trainer_turns_dropout_off_unless_asked(tiny_model, tmp_path, keep, register_plugin):
    import json
    import shutil

    from hybridrl_testing import SevensPlugin

    from hybridrl.config import load_config
    from hybridrl.run import build_run

    register_plugin(SevensPlugin(), name="sevens")
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"attention_dropout": 0.5}))
    run = build_run(load_config(data={
        "model": {"path": str(folder), "dropout": keep},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 8},
        "rewards": [{"function": "sevens"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.05},
        "trainer": {"run_dir": str(tmp_path / "run")},
        "logging": {"loggers": []},
    }))  # fmt: skip
    for model in (run.policy, run.ref):
        rates = {m.attention_dropout for m in model.modules() if hasattr(m, "attention_dropout")}
        assert rates == ({0.5} if keep else {0.0})


@pytest.mark.parametrize("keep_bytes", [2**30, 0], ids=["kept", "recomputed"])
def test_fused_output_layer_gives_the_same_values_and_gradients(model, keep_bytes):
    """The compiled chunk (sharding compile) against the eager one: logits kept for the backward
    pass, or (a budget of 0 bytes) recomputed chunk by chunk."""
    ids, _ = padded_batch(model.config.vocab_size)
    hidden = torch.randn(3, 6, model.config.hidden_size) * 3
    tokens = ids[:, :6]
    head = model.get_output_embeddings()

    def run(**kw):
        h = hidden.clone().requires_grad_()
        head.zero_grad()
        lp, ent = chunked_head_logprobs(h, head, tokens, 0.7, with_entropy=True, entropy_grad=True, **kw)
        (lp.sum() + 0.5 * ent.sum()).backward()
        return lp.detach(), ent.detach(), h.grad, head.weight.grad.clone()

    want = run()
    got = run(fused=True, keep_bytes=keep_bytes, chunk_bytes=4 * head.out_features * 5)  # 5 tokens a chunk
    assert want[0].std() > 0.1 and want[1].std() > 0.01  # sharpened head: values that differ per token
    for w, g in zip(want, got):  # float32 rounding of sums over the vocabulary, at the values' scale
        assert torch.allclose(w, g, rtol=1e-4, atol=1e-5 * float(w.abs().max().clamp(min=1)))


def test_the_fused_output_layer_compiles_once_for_passes_of_any_number_of_tokens():
    """sharding.compile's fused output layer marks a pass's number of tokens dynamic, but torch.compile
    gives a size of 1 a graph of its own: a pass of one 1-token response compiled again mid-run (the
    trainer's note named it: ``_head_chunk: 2 <= hidden.size()[0]``). One token now runs as two, the
    second dropped: nothing compiles after the first pass, with the eager layer's values and gradients."""
    import torch._dynamo

    from hybridrl.compile import allow_recompiles, recompile_reasons

    torch._dynamo.reset()
    allow_recompiles()
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50)
    for i, n in enumerate((5, 1, 3, 1)):
        hidden, tokens = torch.randn(1, n, 8, requires_grad=True), torch.randint(0, 50, (1, n))
        lp, ent = chunked_head_logprobs(hidden, head, tokens, 0.7, True, True, fused=True, keep_bytes=2**30)
        want, want_ent = chunked_head_logprobs(hidden, head, tokens, 0.7, True, True)  # eager
        assert lp.shape == ent.shape == (1, n)
        torch.testing.assert_close((lp, ent), (want, want_ent))
        got = torch.autograd.grad((lp + ent).sum(), (hidden, head.weight))
        torch.testing.assert_close(got, torch.autograd.grad((want + want_ent).sum(), (hidden, head.weight)))
        if i == 0:
            recompile_reasons()  # the first pass compiles
    assert recompile_reasons() == []


def test_compiled_strategy_routes_response_logprobs_through_the_fused_layer(model, tmp_path, monkeypatch):
    from hybridrl import forward, plugins
    from hybridrl.components import RunContext
    from hybridrl.passes import Runner

    calls = []
    real = forward._fused_chunk()
    monkeypatch.setattr(forward, "_fused_chunk", lambda: lambda *a: calls.append(a[3].shape) or real(*a))
    ids, mask = padded_batch(model.config.vocab_size)
    want, _ = response_logprobs(model, ids, mask, 9)
    single = plugins.lookup("sharding strategy", "single")
    ctx = RunContext("", None, torch.device("cpu"), torch.float32, 0, tmp_path)
    strategy = single(single.Options(compile=True), ctx)  # its models' handles get the fused output layer
    handle = Runner(strategy=strategy).handle(model)
    assert handle.fused_head_bytes == 8 * 2**30
    assert not [name for name in vars(model) if name.startswith("_hybridrl")]  # nothing hung on the model
    got, _ = response_logprobs(handle, ids, mask, 9)
    assert calls == [(3 * 6, model.config.hidden_size)]  # one chunk: the 6 kept response columns of 3 rows
    assert torch.allclose(got, want, atol=1e-5)


def grouped_batch(vocab: int):
    """3 prompts x 3 responses, as GRPO sends them: the rows of a group share their prompt (ids
    and left padding), the groups differ in prompt length; responses right-padded to 8, the last
    column padding in every row. P = 6, T = 8."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (9, 14), generator=g)
    mask = torch.ones_like(ids)
    for group, lead in enumerate([0, 2, 4]):
        prompt = torch.randint(3, vocab, (6,), generator=g)
        for row in range(3 * group, 3 * group + 3):
            ids[row, :6], mask[row, :lead] = prompt, 0
            mask[row, 6 + [7, 3, 1][row % 3] :] = 0
    ids[mask == 0] = 0
    return ids, mask


@pytest.mark.parametrize("path", ["chunked", "plain"])
@pytest.mark.parametrize("arch", ["qwen2", "llama", "phi3", "gemma", "gpt2"])
def test_shared_prompts_give_the_full_passes_values_and_gradients(arch, path):
    model = disable_dropout(small_model(arch))
    handle = ModelHandle(model)
    if path == "plain":
        handle.plain_head()  # as under FSDP or for models that transform their logits
    assert (handle.head_split() is None) == (path == "plain")  # checked before tokens are counted
    ids, mask = grouped_batch(64)
    T = 8
    resp = mask[:, -T:].bool()

    def run(share):
        model.zero_grad()
        out = dict(with_entropy=True, entropy_grad=True, share_prompts=share)
        lp, ent = response_logprobs(handle, ids, mask, T, 0.7, **out)
        (lp[resp].sum() + 0.3 * ent[resp].sum()).backward()
        return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    (want_lp, want_ent, want_grad), full_tokens = embedded_tokens(model, lambda: run(False))
    (lp, ent, grad), shared_tokens = embedded_tokens(model, lambda: run(True))
    assert full_tokens == 9 * 13  # every row's prompt and response, the padding column cut
    assert shared_tokens == 3 * 6 + 9 * 7  # each prompt once, then every response
    assert (lp[resp] - want_lp[resp]).abs().max() < 1e-5
    assert (ent[resp] - want_ent[resp]).abs().max() < 1e-5
    assert (lp[:, -1] == 0).all()  # the column of padding in every row comes back as zeros
    for n in want_grad:
        assert (grad[n] - want_grad[n]).abs().max() <= 1e-5 * want_grad[n].abs().max(), n


def test_shared_prompts_keep_the_plain_pass_without_repeated_prompts_or_with_checkpointing(model):
    handle = ModelHandle(model)
    handle.head_split()  # its one-time probe, before the tokens are counted
    ids, mask = padded_batch(model.config.vocab_size)  # three different prompts
    _, tokens = embedded_tokens(model, lambda: response_logprobs(handle, ids, mask, 9))
    assert tokens == 3 * (16 - 2 - 3)  # one pass over every row
    ids, mask = grouped_batch(model.config.vocab_size)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        model.train()
        with torch.no_grad():
            want, _ = reference(model, ids, mask, 8)
        lp, tokens = embedded_tokens(model, lambda: response_logprobs(handle, ids, mask, 8)[0])
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
    assert tokens == 9 * 13  # recomputed layers cannot fill a KV cache: one plain pass
    resp = mask[:, -8:].bool()
    assert (lp[resp] - want[resp]).abs().max() < 1e-5


@pytest.mark.parametrize("share", ["auto", False])
def test_the_trainer_shares_prompts_on_the_cpu_unless_told_not_to(
    tiny_model, tmp_path, share, register_plugin, monkeypatch
):
    """One GRPO step: with trainer.share_prompts 'auto' (on for the CPU) the reference's and the
    policy's passes run each prompt once; with false, once per response, packed (trainer.pack_sequences
    'auto' packs where prompts are not shared)."""
    from hybridrl_testing import SevensPlugin

    from hybridrl import passes, trainer
    from hybridrl.config import load_config
    from hybridrl.run import build_run

    calls = []

    def recording(handle, ids, mask, T, out, p):
        calls.append((handle.model, p.layout))
        return run(handle, ids, mask, T, out, p)

    run = passes.run_logprobs
    monkeypatch.setattr(passes, "run_logprobs", recording)
    register_plugin(SevensPlugin(), name="sevens")
    t = trainer.Trainer(build_run(load_config(data={
        "model": {"path": tiny_model},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 8},
        "rollout": {"n": 4, "max_tokens": 6},
        "rewards": [{"function": "sevens"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.05},
        "trainer": {"prompts_per_step": 2, "share_prompts": share, "run_dir": str(tmp_path / "run")},
        "logging": {"loggers": []},
    })))  # fmt: skip
    for logger in t.run.loggers:  # train() would open them
        logger.open(1, 0)
    t.step(1)
    assert {model is t.run.ref for model, _ in calls} == {True, False}  # the reference's pass and the policy's
    planner = t.run.passes.planner  # trainer.share_prompts and trainer.pack_sequences resolved, there alone
    assert (planner.share, planner.pack) == (share == "auto", share is False)
    # packed where that saves tokens, which these sequences of nearly equal lengths do not: padded
    assert {layout for _, layout in calls} == {passes.SHARED if share == "auto" else passes.PADDED}
