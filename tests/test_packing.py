"""Packed passes (trainer.pack_sequences): the padded passes' logprobs, entropies and gradients from fewer tokens."""

import pytest
import torch

from hybridrl import packing
from hybridrl.models import can_pack, disable_dropout, head_split, keeps_sequences_apart, response_logprobs
from hybridrl.testing import embedded_tokens, small_model


def test_first_fit_puts_each_sequence_longest_first_into_the_first_row_with_room():
    # longest first: 6 -> row 0, 5 -> row 1, 4 -> row 2, 3 -> row 1 (after the 5), 2 -> row 0 (after the 6)
    where, start, rows = packing.first_fit([5, 3, 4, 2, 6], 8)
    assert (where, start, rows) == ([1, 1, 2, 0, 0], [0, 5, 0, 6, 0], 3)
    assert packing.first_fit([8, 8], 8) == ([0, 1], [0, 0], 2)  # full rows open new ones
    assert packing.first_fit([], 8) == ([], [], 0)


def test_passes_take_consecutive_packed_rows_up_to_the_budget():
    # packed rows of 8: [6, 2] (rows 4 and 3), [5, 3] (rows 0 and 1), [4] (row 2)
    assert packing.passes([5, 3, 4, 2, 6], 8, 16) == [[3, 4, 0, 1], [2]]  # two packed rows a pass
    assert packing.passes([5, 3, 4, 2, 6], 8, 7) == [[3, 4], [0, 1], [2]]  # a budget under a row: one each
    assert packing.passes([], 8, 16) == []


def test_the_rows_of_a_pass_packed_on_their_own_take_no_more_packed_rows():
    """What a pass runs (its rows packed again) stays within the budget its cut assumed."""
    import random

    rng = random.Random(0)
    for _ in range(2000):
        width = rng.randint(4, 30)
        lengths = [rng.randint(1, width) for _ in range(rng.randint(1, 40))]
        budget = width * rng.randint(1, 6)
        for rows in packing.passes(lengths, width, budget):
            assert packing.first_fit([lengths[i] for i in rows], width)[2] * width <= budget, (lengths, width)


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
    assert head_split(model) is not None and keeps_sequences_apart(model.base_model)
    ids, mask = batch_of_lengths(64)
    T = 8
    resp = mask[:, -T:].bool()

    def run(pack):
        model.zero_grad()
        lp, ent = response_logprobs(
            model, ids, mask, T, 0.7, with_entropy=True, entropy_grad=True, share_prompts=False, pack=pack
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
    assert not keeps_sequences_apart(body)
    ids, mask = batch_of_lengths(64)
    with torch.no_grad():
        want, _ = response_logprobs(model, ids, mask, 8, share_prompts=False)
        packed = lambda: response_logprobs(model, ids, mask, 8, share_prompts=False, pack=True)  # noqa: E731
        (got, _), tokens = embedded_tokens(model, packed)
    assert tokens == 9 * 13
    assert torch.equal(got, want)


def test_compiled_blocks_run_packed_passes_with_the_eager_padded_values(monkeypatch):
    """sharding.compile's blocks and fused output layer, over packed rows of two shapes (the
    passes of a step): the eager padded pass's logprobs and gradients."""
    from hybridrl.models import find_blocks, fuse_output_layer

    monkeypatch.setattr(packing, "WIDTH_MULTIPLE", 16)
    model = disable_dropout(small_model("qwen2"))
    ids, mask = batch_of_lengths(64)
    T, resp = 8, mask[:, -8:].bool()

    def run(pack, rows):
        model.zero_grad()
        lp, _ = response_logprobs(model, ids[rows], mask[rows], T, 0.7, share_prompts=False, pack=pack)
        lp[resp[rows]].sum().backward()
        return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    parts = [list(range(9)), [0, 3, 4, 6]]  # 5 and 3 packed rows of 16
    want = [run(False, rows) for rows in parts]
    for block in find_blocks(model):
        block.compile()
    fuse_output_layer(model, 2**30)
    assert can_pack(model)  # its one-time check, before the tokens are counted
    for rows, packed_rows, (want_lp, want_grad) in zip(parts, [5, 3], want):
        (lp, grad), tokens = embedded_tokens(model, lambda: run(True, rows))  # noqa: B023 - called at once
        assert tokens == packed_rows * 16
        assert (lp[resp[rows]] - want_lp[resp[rows]]).abs().max() < 1e-5
        for n in want_grad:
            assert (grad[n] - want_grad[n]).abs().max() <= 1e-4 * want_grad[n].abs().max(), n
