"""Token-budget micro-batches (trainer.micro_batch_tokens): fewer padded tokens, the same
logprobs and gradients as one pass over the whole batch."""

import time

import pytest
import torch
from hybridrl_testing import SevensPlugin, fixed_batch

from hybridrl import packing
from hybridrl.batch import Batch, token_budget_split
from hybridrl.compile import compile_seconds
from hybridrl.config import ConfigError, load_config
from hybridrl.passes import split_widest
from hybridrl.run import build_run
from hybridrl.trainer import Trainer

LENGTHS = [[2, 3, 4, 2], [14, 12, 10, 13], [5, 9, 1, 7], [11, 3, 8, 6]]  # 4 groups of 4 responses


def masks(prompt_lens, response_lens):
    batch = Batch()
    P, T = max(prompt_lens), max(response_lens)
    batch["prompt_mask"] = torch.tensor([[0] * (P - p) + [1] * p for p in prompt_lens])
    batch["response_mask"] = torch.tensor([[1] * r + [0] * (T - r) for r in response_lens])
    return batch


def test_groups_fit_the_budget_longest_first_and_cover_every_row_once():
    b = masks([3, 5, 4, 3, 2], [10, 2, 7, 1, 30])
    groups = token_budget_split(b, 24)
    # longest first: 4 (32 tokens, over the budget: alone), 0 (13), 2 (11), 1 (7), 3 (4). Row 0 goes
    # alone (with row 2: 2 x 14 = 28 > 24); the rest takes 2 passes at least, and of those cuts
    # [2] [1, 3] (11 + 2 x 7 = 25 tokens) pads less than [2, 1] [3] (2 x 12 + 4 = 28)
    assert groups == [[4], [0], [2], [1, 3]]
    assert sorted(i for g in groups for i in g) == list(range(5))
    assert token_budget_split(b, 10**6) == [[4, 0, 2, 1, 3]]  # by default: one pass, as it fits
    assert token_budget_split(b, 10**6, pass_cost=0) == [[4], [0], [2], [1], [3]]  # no padding at all


def padded(b, groups):
    p, r = b["prompt_mask"].sum(-1), b.response_lengths()
    return sum(len(g) * int(p[g].max() + r[g].max()) for g in groups)


def test_long_tail_lengths_run_the_few_long_responses_apart():
    # 60 responses of 20-40 tokens and 4 of 250-256 behind 100-token prompts: one pass pads all 64 to
    # 356 tokens (22,784); apart, the short ones take 60 x 216 fewer, more than a pass costs
    lengths = [20 + i % 21 for i in range(60)] + [250, 252, 254, 256]
    b = masks([100] * 64, lengths)
    assert len(token_budget_split(b, 10**6)) == 1  # by default: one pass, as it fits
    groups = token_budget_split(b, 10**6, pass_cost=4096)
    assert sorted(map(sorted, groups)) == [list(range(60)), [60, 61, 62, 63]]
    assert padded(b, groups) == 4 * 356 + 60 * 140 < 64 * 356


def test_the_cut_is_the_cheapest_of_every_cut_within_the_budget():
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        n = int(torch.randint(1, 8, (1,), generator=gen))
        prompts, responses = torch.randint(1, 20, (n,), generator=gen), torch.randint(1, 60, (n,), generator=gen)
        b = masks(prompts.tolist(), responses.tolist())
        budget, cost = int(torch.randint(20, 300, (1,), generator=gen)), int(torch.randint(0, 80, (1,), generator=gen))
        groups = token_budget_split(b, budget, pass_cost=cost)
        order = [i for g in groups for i in g]
        best = float("inf")
        for mask in range(2 ** (n - 1)):  # every cut of the rows in this order into runs
            cuts = [0] + [k + 1 for k in range(n - 1) if mask >> k & 1] + [n]
            runs = [order[a:z] for a, z in zip(cuts, cuts[1:])]
            if all(len(g) == 1 or padded(b, [g]) <= budget for g in runs):
                best = min(best, padded(b, runs) + cost * len(runs))
        assert padded(b, groups) + cost * len(groups) == best
        assert all(len(g) == 1 or padded(b, [g]) <= budget for g in groups)


def test_a_rank_with_fewer_passes_splits_its_most_padded_ones_to_match_the_others():
    # under torchrun every rank runs as many passes as the rank with the most
    b = masks([10] * 6, [40, 38, 30, 5, 4, 3])
    groups = token_budget_split(b, 10**6)
    assert groups == [[0, 1, 2, 3, 4, 5]]  # 6 x 50 = 300 tokens
    three = split_widest(b, groups, 3)
    # halves of the widest each time: [0, 1, 2] [3, 4, 5] (150 + 45), then [0] [1, 2] (50 + 96)
    assert three == [[0], [1, 2], [3, 4, 5]]
    assert padded(b, three) == 50 + 2 * 48 + 3 * 15 < padded(b, groups)
    assert split_widest(b, groups, 1) == groups
    assert sorted(i for g in split_widest(b, groups, 6) for i in g) == list(range(6))


def config(model, run_dir, **trainer):
    return {
        "model": {"path": model},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 16},
        "rollout": {"n": 4, "max_tokens": 16},
        "rewards": [{"function": "sevens"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.05},
        # padded passes: a pass is then one forward call of the padded rows, which these tests count
        "trainer": {"prompts_per_step": 4, "run_dir": str(run_dir), "max_grad_norm": 1e6}
        | {"share_prompts": False, "pack_sequences": False}
        | trainer,
        "logging": {"loggers": []},
    }


def one_update(model, run_dir, lengths=LENGTHS, **trainer):
    """Reference logprobs and the gradients of one update on a fixed batch of mixed lengths."""
    t = Trainer(build_run(load_config(data=config(model, run_dir, **trainer))))
    run = t.run
    batch = fixed_batch(run.tokenizer, lengths)
    t.compute_logprobs(batch)
    run.algorithm.compute_advantages(batch)
    grads = {}
    run.optimizer.step = lambda: grads.update({n: p.grad.clone() for n, p in run.policy.named_parameters()})
    run.passes.handle(run.policy).can_pack()  # its one-time checks (output layer, packing) are not passes of the update
    passes = []  # (padded) tokens of each forward pass of the update
    run.policy.base_model.register_forward_pre_hook(
        lambda m, args, kwargs: passes.append(kwargs["input_ids"].numel()), with_kwargs=True
    )
    t.update(batch, 1)
    mask = batch["response_mask"].bool()
    return batch["ref_logprobs"][mask], grads, passes


def test_token_budget_gives_the_same_logprobs_and_gradients_with_less_padding(tiny_model, tmp_path, register_plugin):
    register_plugin(SevensPlugin(), name="sevens")
    ref_lp, grads, passes = one_update(tiny_model, tmp_path / "whole")
    ref_lp2, grads2, passes2 = one_update(tiny_model, tmp_path / "budget", micro_batch_tokens=64)
    assert torch.allclose(ref_lp, ref_lp2, atol=1e-5)  # back in the batch's order
    for name in grads:
        assert torch.allclose(grads[name], grads2[name], rtol=1e-4, atol=1e-7), name
    # several passes, each within the budget, fewer (padded) tokens through the model than one pass
    assert len(passes) == 1 and len(passes2) > 2
    assert max(passes2) <= 64 and sum(passes2) < passes[0]


def test_packed_passes_give_the_padded_updates_logprobs_and_gradients(
    tiny_model, tmp_path, register_plugin, monkeypatch
):
    """trainer.pack_sequences: the reference pass and the update of a step run packed rows of the
    trainer's passes, with the padded passes' logprobs and gradients and fewer tokens."""
    monkeypatch.setattr(packing, "WIDTH_MULTIPLE", 4)
    register_plugin(SevensPlugin(), name="sevens")
    long_tail = [[1, 2, 40, 1], [2, 1, 1, 3], [33, 1, 2, 1], [1, 4, 1, 2]]  # most short, two long
    ref_lp, grads, passes = one_update(tiny_model, tmp_path / "padded", long_tail)
    ref_lp2, grads2, passes2 = one_update(tiny_model, tmp_path / "packed", long_tail, pack_sequences=True)
    assert torch.allclose(ref_lp, ref_lp2, atol=1e-5)
    for name in grads:
        assert torch.allclose(grads[name], grads2[name], rtol=1e-4, atol=1e-7), name
    assert len(passes2) == len(passes) and sum(passes2) < sum(passes)
    assert all(n % 4 == 0 for n in passes2)  # rows of a multiple of 4 tokens
    # with a budget, the passes are cut from the packed rows (of 54 tokens: the batch's longest
    # prompt, 14, and response, 40), two a pass; a pass that runs fewer tokens padded runs padded
    ref_lp3, grads3, passes3 = one_update(
        tiny_model, tmp_path / "budget", long_tail, pack_sequences=True, micro_batch_tokens=112
    )
    assert torch.allclose(ref_lp, ref_lp3, atol=1e-5)
    for name in grads:
        assert torch.allclose(grads[name], grads3[name], rtol=1e-4, atol=1e-7), name
    assert passes3 == [2 * 54, 2 * 54, 6 * 15, 2 * 15]  # the last two: 6 and 2 short rows, padded


def test_token_budget_and_micro_batch_size_together_are_refused(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="micro_batch_size and trainer.micro_batch_tokens both set"):
        load_config(data=config(tiny_model, tmp_path, micro_batch_size=4, micro_batch_tokens=64))


def test_bytes_a_token_takes_by_hand_for_the_qwen2_5_0_5b_shape():
    """(17 h + 6 I) b per layer, h b with activation checkpointing plus one layer, V (b + 8) for
    the output layer (hybridrl.memory's docstring)."""
    from transformers import Qwen2Config

    from hybridrl.memory import bytes_per_token

    cfg = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, vocab_size=151936)
    layer = (17 * 896 + 6 * 4864) * 2  # 88,832 bytes in bf16
    assert bytes_per_token(cfg, 2) == 24 * layer + 151936 * 10 == 3_651_328
    assert bytes_per_token(cfg, 2, checkpointing=True) == 24 * 896 * 2 + layer + 151936 * 10 == 1_651_200


def test_auto_budget_is_a_share_of_the_free_memory_and_splits_like_that_budget(
    tiny_model, tmp_path, register_plugin, monkeypatch, capsys
):
    """micro_batch_tokens: auto (the default) where free memory is known (a GPU; here the CPU is told
    it has some): the passes of an explicit budget of the same size, and a line that says so."""
    from transformers import AutoConfig

    from hybridrl import memory

    register_plugin(SevensPlugin(), name="sevens")
    per_token = memory.bytes_per_token(AutoConfig.from_pretrained(tiny_model), 4)  # float32 on the CPU
    monkeypatch.setattr(memory, "AUTO_FRACTION", 0.5)
    monkeypatch.setattr(memory, "free_bytes", lambda device: 2 * 64 * per_token)
    ref_lp, grads, passes = one_update(tiny_model, tmp_path / "auto")
    assert "micro-batches: up to 64 tokens a pass" in capsys.readouterr().out
    ref_lp2, grads2, passes2 = one_update(tiny_model, tmp_path / "budget", micro_batch_tokens=64)
    assert passes == passes2 and len(passes) > 2
    assert torch.equal(ref_lp, ref_lp2)


def oom(*args, **kwargs):
    raise torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.8 GiB"
    )


def test_out_of_memory_in_each_stage_names_it_the_sizes_and_the_option_to_change(
    tiny_model, tmp_path, register_plugin, monkeypatch
):
    import hybridrl.passes
    from hybridrl.memory import OutOfMemory

    register_plugin(SevensPlugin(), name="sevens")
    t = Trainer(build_run(load_config(data=config(tiny_model, tmp_path / "run", micro_batch_tokens=64))))
    t.run.engine.generate = oom
    with pytest.raises(
        OutOfMemory,
        match=r"out of memory in rollout engine 'hf' generate on cpu: 4 prompts x 4 samples "
        r"of up to \d+ \+ 16 tokens. Lower rollout.batch_size \(prompts per generate call; try 2\), or "
        r"rollout.max_tokens. \(CUDA out of memory.\)",
    ):
        t.run.rollout.generate(1)

    batch = fixed_batch(t.run.tokenizer, LENGTHS)
    with monkeypatch.context() as m:
        m.setattr(hybridrl.passes, "run_logprobs", oom)
        with pytest.raises(
            OutOfMemory,
            match=r"in the logprobs of the reference model on cpu: a pass of \d+ responses x "
            r"\d+ tokens \(\d+ tokens\). Set trainer.micro_batch_tokens \(try \d+\)",
        ):
            t.compute_logprobs(batch)
    t.compute_logprobs(batch)
    t.run.algorithm.compute_advantages(batch)
    t.run.algorithm.loss = oom
    with pytest.raises(
        OutOfMemory,
        match=r"in the update of the policy \(algorithm 'grpo'\) on cpu: a pass of .* "
        r"Set trainer.micro_batch_tokens \(try \d+\) or sharding.activation_checkpointing: true",
    ):
        t.update(batch, 1)

    t = Trainer(build_run(load_config(data=config(tiny_model, tmp_path / "run2", micro_batch_size=8))))
    t.run.algorithm.loss = oom
    t.compute_logprobs(batch)
    t.run.algorithm.compute_advantages(batch)
    with pytest.raises(OutOfMemory, match=r"a pass of 8 responses .* Lower trainer.micro_batch_size \(try 4\)"):
        t.update(batch, 1)


def test_compiled_passes_stay_compiled_over_steps_of_new_lengths(tiny_model, tmp_path, register_plugin, monkeypatch):
    """sharding.compile with packed passes: a step's passes reach a compiled block in many variants
    (with and without gradients, packed rows with an attention mask or without one, left-padded
    rows, a first static graph then a dynamic one, one row). torch.compile keeps 8 graphs a
    function by default and runs any further variant eagerly for the rest of the run; every
    variant of these steps gets its graph."""
    import random

    import torch._dynamo

    monkeypatch.setattr(packing, "WIDTH_MULTIPLE", 8)
    torch._dynamo.reset()
    register_plugin(SevensPlugin(), name="sevens")
    cfg = config(tiny_model, tmp_path, pack_sequences=True, micro_batch_tokens=96) | {"sharding": {"compile": True}}
    frames = torch._dynamo.utils.counters["frames"]  # the process's: earlier tests' frames count too
    skipped = frames["total"] - frames["ok"]
    graphs = torch._dynamo.utils.counters["stats"]
    rng = random.Random(0)
    with torch._dynamo.config.patch(recompile_limit=8):  # the default; restored afterwards
        t = Trainer(build_run(load_config(data=cfg)))
        assert t.run.passes.handle(t.run.policy).fused_head_bytes == 8 * 2**30  # the compiled, fused output layer
        assert (
            t.run.passes.planner.width == t.run.strategy.pack_width == packing.pack_width(t.run.ctx.prompt_tokens + 16)
        )
        for step in (1, 2, 3, 4, 5):
            compiled, start = compile_seconds(), time.perf_counter()
            lengths = [[min(16, 1 + int(rng.expovariate(1 / 4))) for _ in range(4)] for _ in range(4)]
            batch = fixed_batch(t.run.tokenizer, lengths)
            t.compute_logprobs(batch)
            t.run.algorithm.compute_advantages(batch)
            t.update(batch, step)
            ran_eagerly = frames["total"] - frames["ok"] - skipped
            assert ran_eagerly == 0, f"step {step}: {ran_eagerly} variant(s) ran eagerly (torch.compile's limit)"
            compiling = compile_seconds() - compiled  # the step's timing/compile
            if step == 1:
                after_first = graphs["unique_graphs"]
                # the backward graphs compile within the forward's compilation: counted once
                assert 0 < compiling <= time.perf_counter() - start
            else:
                assert compiling == 0
            # no stall: steps of new lengths and row counts reuse the first step's graphs
            assert graphs["unique_graphs"] == after_first, f"step {step} compiled again"


def test_a_step_that_compiles_again_says_why(tiny_model, tmp_path, register_plugin, monkeypatch, capsys):
    """A step after the first that compiled again (a stall) prints torch.compile's reasons, heard from
    torch's own recompiles log, which stays quiet; the first step's compiling is expected and says nothing."""
    import torch._dynamo

    from hybridrl import probes
    from hybridrl.compile import recompile_reasons, recompiled

    f = torch.compile(lambda x: x * 2)
    recompile_reasons()
    f(torch.ones(3))
    assert recompile_reasons() == []
    f(torch.ones(5))  # a new size: torch compiles the function again, dynamic
    (reason,) = recompile_reasons()
    assert reason.startswith("<lambda> (test_micro_batches.py:")
    assert reason.endswith("): tensor 'x' size mismatch at index 0. expected 3, actual 5")
    assert "Recompiling" not in capsys.readouterr().err  # quiet unless TORCH_LOGS asks for it

    note = recompiled(7, 3.99, [reason, reason, "b", "c", "d", "e"])
    assert note.startswith(f"step 7: torch.compile compiled again (6x, 4.0s): {reason}; b; c; and 2 more. ")

    register_plugin(SevensPlugin(), name="sevens")
    t = Trainer(build_run(load_config(data=config(tiny_model, tmp_path))))
    for logger in t.run.loggers:  # train() would open them
        logger.open(1, 0)
    heard = iter([[], ["first (a.py:1): at step 1"], [], ["forward (b.py:2): at step 2"]])
    monkeypatch.setattr(probes, "recompile_reasons", lambda: next(heard))
    t.step(1)
    t.step(2)
    out = capsys.readouterr().out
    assert "at step 1" not in out
    assert "step 2: torch.compile compiled again (1x, 0.0s): forward (b.py:2): at step 2." in out
