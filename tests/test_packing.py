"""Packed passes (trainer.pack_sequences): the padded passes' logprobs, entropies and gradients from fewer tokens."""

import pytest
import torch
from hybridrl_testing import embedded_tokens, small_model

from hybridrl import forward, packing
from hybridrl.forward import ModelHandle
from hybridrl.models import disable_dropout
from hybridrl.passes import response_logprobs


def passes(lengths, width, budget):
    """The row indices of the passes :func:`packing.cut` cuts."""
    return [rows for rows, _ in packing.cut(lengths, width, budget)]


def test_first_fit_puts_each_sequence_longest_first_into_the_first_row_with_room():
    # longest first: 6 -> row 0, 5 -> row 1, 4 -> row 2, 3 -> row 1 (after the 5), 2 -> row 0 (after the 6)
    where, start, rows = packing.first_fit([5, 3, 4, 2, 6], 8)
    assert (where, start, rows) == ([1, 1, 2, 0, 0], [0, 5, 0, 6, 0], 3)
    assert packing.first_fit([8, 8], 8) == ([0, 1], [0, 0], 2)  # full rows open new ones
    assert packing.first_fit([], 8) == ([], [], 0)


def test_passes_take_consecutive_packed_rows_up_to_the_budget():
    # packed rows of 8: [6, 2] (rows 4 and 3), [5, 3] (rows 0 and 1), [4] (row 2)
    assert passes([5, 3, 4, 2, 6], 8, 16) == [[3, 4, 0, 1], [2]]  # two packed rows a pass
    assert passes([5, 3, 4, 2, 6], 8, 7) == [[3, 4], [0, 1], [2]]  # a budget under a row: one each
    assert passes([], 8, 16) == []


def test_each_pass_runs_its_rows_where_the_one_first_fit_of_the_batch_put_them():
    """A pass's placement is its share of the batch's packed rows: within the budget the cut assumed,
    every sequence in a row of its own pass, none overlapping."""
    import random

    rng = random.Random(0)
    for _ in range(2000):
        width = rng.randint(4, 30)
        lengths = [rng.randint(1, width) for _ in range(rng.randint(1, 40))]
        budget = width * rng.randint(1, 6)
        for rows, placed in packing.cut(lengths, width, budget):
            assert placed.tokens() <= budget, (lengths, width)
            used = [[0] * width for _ in range(placed.rows)]
            for i, r, c in zip(rows, placed.where, placed.start):
                for k in range(c, c + lengths[i]):
                    used[r][k] += 1
            assert max(max(row) for row in used) == 1, (lengths, width)


def test_pack_width_rounds_up_to_the_multiple():
    assert [packing.pack_width(n) for n in (1, 128, 129, 384, 385)] == [128, 128, 256, 384, 512]


def batch_of_lengths(vocab: int):
    """Three prompts of 6, 4 and 2 tokens (left padding), three responses each of 7, 3 and 1
    tokens (right padding to 8, the last column padding in every row): P = 6, T = 8."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (9, 14), generator=g)
    mask = torch.ones_like(ids)
    for group, lead in enumerate([0, 2, 4]):
        for row in range(3 * group, 3 * group + 3):
            mask[row, :lead] = 0
            mask[row, 6 + [7, 3, 1][row % 3] :] = 0
    ids[mask == 0] = 0
    return ids, mask


def test_pack_lays_the_attended_tokens_end_to_end_with_their_own_positions():
    ids, mask = batch_of_lengths(64)
    p = packing.pack(ids, mask, 8, width=16)
    lengths = mask.sum(1).tolist()  # 13, 9, 7, 11, 7, 5, 9, 5, 3
    where, start, rows = packing.first_fit(lengths, 16)
    assert p.input_ids.shape == (rows, 16) == (5, 16)  # 69 tokens in 80, where padding took 9 x 13 = 117
    for i, n in enumerate(lengths):
        got = p.input_ids[where[i], start[i] : start[i] + n]
        assert torch.equal(got, ids[i][mask[i].bool()])  # the sequence, prompt then response
        assert p.position_ids[where[i], start[i] : start[i] + n].tolist() == list(range(n))
    # the response tokens: predicted by the position before each, back to their row and column
    assert len(p.tokens) == int(mask[:, 6:].sum())
    flat = p.input_ids.reshape(-1)
    assert torch.equal(flat[p.predicting + 1], p.tokens)
    assert torch.equal(ids[p.rows, 6 + p.columns], p.tokens)


def test_pack_refuses_layouts_it_cannot_pack():
    ids, mask = batch_of_lengths(64)
    gap = mask.clone()
    gap[0, 8] = 0  # a hole in the middle of a response
    assert packing.pack(ids, gap, 8) is None
    empty = mask.clone()
    empty[1, :6] = 0  # a response without a prompt token before it
    assert packing.pack(ids, empty, 8) is None


@pytest.mark.parametrize(
    "arch,attention", [(a, "sdpa") for a in ("qwen2", "llama", "phi3", "gemma", "gpt2")] + [("qwen2", "eager")]
)
def test_packed_passes_give_the_padded_passes_values_and_gradients(arch, attention, monkeypatch):
    monkeypatch.setattr(packing, "WIDTH_MULTIPLE", 16)
    model = disable_dropout(small_model(arch))
    model.set_attn_implementation(attention)  # model.attn_implementation
    handle = ModelHandle(model)
    assert handle.head_split() is not None and handle.can_pack()  # probed once, before tokens are counted
    ids, mask = batch_of_lengths(64)
    T = 8
    resp = mask[:, -T:].bool()

    def run(pack):
        model.zero_grad()
        lp, ent = response_logprobs(
            handle, ids, mask, T, 0.7, with_entropy=True, entropy_grad=True, share_prompts=False, pack=pack
        )
        (lp[resp].sum() + 0.3 * ent[resp].sum()).backward()
        return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    (want_lp, want_ent, want_grad), padded = embedded_tokens(model, lambda: run(False))
    (lp, ent, grad), packed = embedded_tokens(model, lambda: run(True))
    assert (padded, packed) == (9 * 13, 5 * 16)  # the padding column cut; 69 tokens in 5 rows of 16
    assert (lp[resp] - want_lp[resp]).abs().max() < 1e-5
    assert (ent[resp] - want_ent[resp]).abs().max() < 1e-5
    assert (lp[~resp] == 0).all() and (ent[~resp] == 0).all()
    for n in want_grad:
        assert (grad[n] - want_grad[n]).abs().max() <= 1e-5 * want_grad[n].abs().max(), n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_that_lets_packed_sequences_see_each_other_runs_padded_passes(dtype):
    model = disable_dropout(small_model("qwen2")).to(dtype)
    body = model.base_model
    forward = body.forward

    def masked_forward(*args, position_ids=None, attention_mask=None, **kw):
        # a model with its own masking: every token attends to every earlier one in the row
        if attention_mask is None:
            attention_mask = torch.ones_like(kw["input_ids"])
        return forward(*args, position_ids=position_ids, attention_mask=attention_mask, **kw)

    body.forward = masked_forward
    handle = ModelHandle(model)
    assert not handle.can_pack()
    ids, mask = batch_of_lengths(64)
    with torch.no_grad():
        want, _ = response_logprobs(handle, ids, mask, 8, share_prompts=False)
        packed = lambda: response_logprobs(handle, ids, mask, 8, share_prompts=False, pack=True)  # noqa: E731
        (got, _), tokens = embedded_tokens(model, packed)
    assert tokens == 9 * 13
    assert torch.equal(got, want)


def test_compiled_blocks_run_packed_passes_with_the_eager_padded_values(monkeypatch):
    """sharding.compile's blocks and fused output layer, over packed rows of two shapes (the
    passes of a step): the eager padded pass's logprobs and gradients."""
    from hybridrl.models import find_blocks

    monkeypatch.setattr(packing, "WIDTH_MULTIPLE", 16)
    model = disable_dropout(small_model("qwen2"))
    ids, mask = batch_of_lengths(64)
    T, resp = 8, mask[:, -8:].bool()
    handle = ModelHandle(model)

    def run(pack, rows):
        model.zero_grad()
        lp, _ = response_logprobs(handle, ids[rows], mask[rows], T, 0.7, share_prompts=False, pack=pack)
        lp[resp[rows]].sum().backward()
        return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    parts = [list(range(9)), [0, 3, 4, 6]]  # 5 and 3 packed rows of 16
    want = [run(False, rows) for rows in parts]
    for block in find_blocks(model):
        block.compile()
    handle = ModelHandle(model, fused_head_bytes=2**30)  # sharding.compile's fused output layer
    assert handle.can_pack()  # its one-time check, before the tokens are counted
    for rows, packed_rows, (want_lp, want_grad) in zip(parts, [5, 3], want):
        (lp, grad), tokens = embedded_tokens(model, lambda: run(True, rows))  # noqa: B023 - called at once
        assert tokens == packed_rows * 16
        assert (lp[resp[rows]] - want_lp[resp[rows]]).abs().max() < 1e-5
        for n in want_grad:
            assert (grad[n] - want_grad[n]).abs().max() <= 1e-4 * want_grad[n].abs().max(), n


# Flash attention on the CPU: transformers' own flash-attention forward, mask and dispatch
# (integrations.flash_attention -> modeling_flash_attention_utils._flash_attention_forward), with
# the kernels emulated by exact attention in float64. transformers runs the variable-length kernel
# with sequence boundaries from position ids only for a batch of one row; several packed rows get
# plain causal attention in each row, where a sequence sees those packed before it.

EMULATED_FLASH = "emulated_flash_attention"  # "flash" in the name: transformers treats it as flash attention
FLASH_KERNEL_CACHE = [  # transformers keeps the kernels it loaded here: restored after each test
    "_loaded_implementation",
    "_flash_fn",
    "_flash_varlen_fn",
    "_flash_with_kvcache_fn",
    "_pad_fn",
    "_unpad_fn",
    "_process_flash_kwargs_fn",
    "_process_with_kvcache_kwargs_fn",
]


def exact_attention(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
    """What a flash kernel computes for one sequence, in float64: q (Sq, H, D), k and v (Sk, Hk, D)
    -> (Sq, H, D) in q's dtype. Causal and window masks aligned to the bottom right (the last query
    sees the last key), as in flash-attn 2; H a multiple of Hk (grouped-query attention)."""
    (Sq, H, D), (Sk, Hk) = q.shape, k.shape[:2]
    k, v = (x.double().repeat_interleave(H // Hk, 1) for x in (k, v))  # (Sk, H, D)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * (D**-0.5 if softmax_scale is None else softmax_scale)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    ahead = torch.arange(Sk, device=q.device)[None] - torch.arange(Sq, device=q.device)[:, None] - (Sk - Sq)  # (Sq, Sk)
    allowed = torch.ones_like(ahead, dtype=torch.bool)
    left, right = window_size
    if causal:
        allowed &= ahead <= 0
    if left >= 0:
        allowed &= ahead >= -left
    if right >= 0:
        allowed &= ahead <= right
    scores = scores.masked_fill(~allowed, float("-inf"))  # (H, Sq, Sk)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)


def emulated_flash_kernels(calls: list):
    """flash-attn's ``flash_attn_func`` and ``flash_attn_varlen_func`` (the arguments transformers
    passes them), computed by :func:`exact_attention`; each call appends ("rows", batch) or
    ("varlen", sequences) to ``calls``."""

    def flash_attn_func(
        q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False
    ):  # (B, S, H, D): each row one sequence
        assert dropout_p == 0, "the emulated kernels have no dropout: disable_dropout(model)"
        calls.append(("rows", q.shape[0]))
        return torch.stack([exact_attention(*x, softmax_scale, causal, window_size, softcap) for x in zip(q, k, v)])

    def flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q=None,
        max_seqlen_k=None,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        deterministic=False,
    ):  # (total, H, D): sequence i at cu_seqlens[i]:cu_seqlens[i + 1]
        assert dropout_p == 0, "the emulated kernels have no dropout: disable_dropout(model)"
        calls.append(("varlen", len(cu_seqlens_q) - 1))
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        parts = zip(cq, cq[1:], ck, ck[1:])
        args = (softmax_scale, causal, window_size, softcap)
        return torch.cat([exact_attention(q[a:b], k[c:d], v[c:d], *args) for a, b, c, d in parts])

    return flash_attn_func, flash_attn_varlen_func


@pytest.fixture
def emulated_flash(monkeypatch):
    """``EMULATED_FLASH`` as an attention implementation for one test: transformers' flash-attention
    forward and mask functions, loading the emulated kernels where they load flash-attn's. Yields
    the kernels' calls (:func:`emulated_flash_kernels`)."""
    from transformers import AttentionInterface
    from transformers import modeling_flash_attention_utils as flash_utils
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    calls = []
    kernels = (*emulated_flash_kernels(calls), None, flash_utils._pad_input, flash_utils._unpad_input)
    load = flash_utils._lazy_imports
    for name in FLASH_KERNEL_CACHE:
        monkeypatch.setattr(flash_utils, name, getattr(flash_utils, name))
    monkeypatch.setattr(
        flash_utils, "_lazy_imports", lambda impl, *a, **kw: kernels if impl == EMULATED_FLASH else load(impl, *a, **kw)
    )
    # what AttentionInterface.register and AttentionMaskInterface.register do, undone after the test
    monkeypatch.setitem(AttentionInterface._global_mapping, EMULATED_FLASH, flash_attention_forward)
    monkeypatch.setitem(AttentionMaskInterface._global_mapping, EMULATED_FLASH, flash_attention_mask)
    yield calls


def test_the_emulated_flash_attention_follows_transformers_dispatch(emulated_flash, monkeypatch):
    """Padded rows: unpadded by their mask into the varlen kernel, the SDPA pass's values. Packed
    rows: several rows run plain causal attention in each; one row the varlen kernel, a sequence
    for each restart of the position ids."""
    monkeypatch.setattr(packing, "WIDTH_MULTIPLE", 16)
    model = disable_dropout(small_model("qwen2"))
    ids, mask = batch_of_lengths(64)
    resp = mask[:, -8:].bool()
    handle = ModelHandle(model)  # its output layer probed once, before the kernels' calls are recorded
    with torch.no_grad():
        want, _ = response_logprobs(handle, ids, mask, 8, share_prompts=False)
        model.set_attn_implementation(EMULATED_FLASH)
        got, _ = response_logprobs(handle, ids, mask, 8, share_prompts=False)
        assert set(emulated_flash) == {("varlen", 9)}
        assert (got[resp] - want[resp]).abs().max() < 1e-5
        p = packing.pack(ids, mask, 8)
        emulated_flash.clear()
        model.base_model(input_ids=p.input_ids, position_ids=p.position_ids)
        assert set(emulated_flash) == {("rows", 5)}
        emulated_flash.clear()
        model.base_model(input_ids=p.input_ids.reshape(1, -1), position_ids=p.position_ids.reshape(1, -1))
        assert set(emulated_flash) == {("varlen", int((p.position_ids == 0).sum()))}


@pytest.mark.parametrize("arch", ["qwen2", "llama", "phi3", "gemma"])
def test_packed_passes_under_flash_attention_give_the_padded_passes_values_and_gradients(
    arch, emulated_flash, monkeypatch
):
    """Several packed rows run end to end as one row, the layout in which flash attention keeps
    sequences apart: the padded pass's values and gradients from the packed pass's tokens."""
    monkeypatch.setattr(packing, "WIDTH_MULTIPLE", 16)
    model = disable_dropout(small_model(arch))
    model.set_attn_implementation(EMULATED_FLASH)
    handle = ModelHandle(model)
    ids, mask = batch_of_lengths(64)
    T = 8
    resp = mask[:, -T:].bool()

    def run(pack):
        model.zero_grad()
        lp, ent = response_logprobs(
            handle, ids, mask, T, 0.7, with_entropy=True, entropy_grad=True, share_prompts=False, pack=pack
        )
        (lp[resp].sum() + 0.3 * ent[resp].sum()).backward()
        return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    assert handle.can_pack()  # its one-time checks, before the tokens and the kernels' calls are counted
    (want_lp, want_ent, want_grad), padded = embedded_tokens(model, lambda: run(False))
    emulated_flash.clear()
    (lp, ent, grad), packed = embedded_tokens(model, lambda: run(True))
    assert (padded, packed) == (9 * 13, 5 * 16)  # packed: 69 tokens in 5 rows of 16
    assert (lp[resp] - want_lp[resp]).abs().max() < 1e-5
    assert (ent[resp] - want_ent[resp]).abs().max() < 1e-5
    for n in want_grad:
        assert (grad[n] - want_grad[n]).abs().max() <= 1e-5 * want_grad[n].abs().max(), n
    assert handle.packed_layout() == forward.ONE_ROW
    assert {kind for kind, _ in emulated_flash} == {"varlen"}  # the 5 rows ran as one


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_packed_rows_under_flash_attention_see_the_sequences_before_them(arch, emulated_flash, monkeypatch):
    """What packed passes did before the guard probed two rows: one packed row keeps its sequences
    apart under flash attention (what a probe of one row sees), several rows do not, and their
    logprobs are far from the padded pass's."""
    monkeypatch.setattr(packing, "WIDTH_MULTIPLE", 16)
    model = disable_dropout(small_model(arch))
    model.set_attn_implementation(EMULATED_FLASH)
    body = model.base_model
    ids, mask = batch_of_lengths(64)
    with torch.no_grad():
        a, b = torch.tensor([[3, 5, 7]]), torch.tensor([[11, 13]])
        alone = torch.cat([body(input_ids=x).last_hidden_state[0] for x in (a, b)])
        one_row = body(input_ids=torch.cat([a, b], 1), position_ids=torch.tensor([[0, 1, 2, 0, 1]]))
        assert (one_row.last_hidden_state[0] - alone).abs().max() < 1e-5
        assert forward.packed_layout(body) == forward.ONE_ROW  # the rows as they are fail the probe
        want, _ = response_logprobs(model, ids, mask, 8, share_prompts=False)
        monkeypatch.setattr(forward, "packed_layout", lambda body: forward.ROWS)  # the rows as they are
        got, _ = response_logprobs(model, ids, mask, 8, share_prompts=False, pack=True)
    resp = mask[:, -8:].bool()
    assert (got[resp] - want[resp]).abs().max() > 1e-2


def test_a_flash_kernel_that_takes_16_bit_inputs_only_is_probed_under_autocast(emulated_flash, monkeypatch):
    """flash-attn refuses float32 inputs; float32 weights train under bfloat16 autocast, so the
    probe runs there too, rather than leaving such a model on padded passes."""
    from transformers import modeling_flash_attention_utils as flash_utils

    def sixteen_bit_only(kernel):
        def run(q, *args, **kwargs):
            if q.dtype not in (torch.float16, torch.bfloat16):
                raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
            return kernel(q, *args, **kwargs)

        return run

    rows, varlen, *rest = flash_utils._lazy_imports(EMULATED_FLASH)
    kernels = (sixteen_bit_only(rows), sixteen_bit_only(varlen), *rest)
    monkeypatch.setattr(flash_utils, "_lazy_imports", lambda impl, *a, **kw: kernels)
    model = disable_dropout(small_model("qwen2"))
    model.set_attn_implementation(EMULATED_FLASH)
    with pytest.raises(RuntimeError, match="fp16 and bf16"):
        model.base_model(input_ids=torch.tensor([[3, 5]]))  # float32, no autocast: refused
    assert forward.packed_layout(model.base_model) == forward.ONE_ROW
