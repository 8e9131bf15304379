"""The pass planner's decisions (hybridrl.passes): shared prompts and packing resolved in one place,
where a budget cuts, how each pass runs, and first-fit once per pass."""

import pytest
import torch
from hybridrl_testing import small_model

from hybridrl import packing, passes
from hybridrl.batch import Batch
from hybridrl.forward import ModelHandle
from hybridrl.memory import MicroBatches
from hybridrl.models import disable_dropout
from hybridrl.passes import PACKED, PADDED, SHARED, Planner, Runner


class Model:
    """What the planner asks of a model's handle, answered as set."""

    def __init__(self, packs=True, checkpointing=False, values=False):
        self.packs, self.checkpoints, self.values = packs, checkpointing, values

    def can_pack(self) -> bool:
        return self.packs

    def checkpointing(self) -> bool:
        return self.checkpoints


def ragged(prompts: list[int], responses: list[int], same_prompt: int = 1, seed: int = 0) -> Batch:
    """Rows of ``prompts[i]`` prompt tokens (left-padded) and ``responses[i]`` response tokens
    (right-padded); ``same_prompt`` consecutive rows share their prompt (a group's samples)."""
    g = torch.Generator().manual_seed(seed)
    P, T = max(prompts), max(responses)
    b = Batch()
    b["prompts"] = torch.randint(3, 60, (len(prompts), P), generator=g)
    for i in range(len(prompts)):
        b["prompts"][i] = b["prompts"][i - i % same_prompt]
    b["prompt_mask"] = torch.tensor([[0] * (P - p) + [1] * p for p in prompts])
    b["responses"] = torch.randint(3, 60, (len(responses), T), generator=g)
    b["response_mask"] = torch.tensor([[1] * r + [0] * (T - r) for r in responses])
    b["prompts"][b["prompt_mask"] == 0] = 0
    b["responses"][b["response_mask"] == 0] = 0
    return b


def budget(tokens: int | None = None, size: int | None = None) -> MicroBatches:
    return MicroBatches(size, tokens, None, None, torch.device("cpu"))


@pytest.mark.parametrize(
    "share,pack,device,want",
    [
        ("auto", "auto", "cpu", (True, False)),  # the CPU shares prompts; auto packs where prompts are not shared
        ("auto", "auto", "cuda", (False, True)),  # a GPU packs
        ("auto", True, "cpu", (False, True)),  # packing asked for: prompts are not shared
        (True, "auto", "cuda", (True, False)),
        (False, "auto", "cpu", (False, True)),
        (False, False, "cpu", (False, False)),
    ],
)
def test_share_prompts_and_pack_sequences_auto_are_resolved_by_the_planner(share, pack, device, want):
    planner = Planner(share, pack, device=torch.device(device))
    assert (planner.share, planner.pack) == want


def test_shared_prompts_where_a_prompt_repeats_and_the_model_keeps_a_kv_cache():
    grouped = ragged([4, 4, 2, 2], [3, 1, 2, 3], same_prompt=2)
    planner = Planner(share_prompts=True)
    (p,) = planner.plan(Model(), grouped)
    assert p.layout == SHARED and p.rows == [0, 1, 2, 3]
    rows, inverse = p.prompts
    assert inverse.tolist() in ([0, 0, 1, 1], [1, 1, 0, 0]) and len(rows) == 2
    assert planner.plan(Model(checkpointing=True), grouped)[0].layout == PADDED  # recomputed layers: no cache
    assert planner.plan(Model(values=True), grouped)[0].layout == PADDED  # a critic's values pass
    assert planner.plan(Model(), ragged([4, 4, 2, 2], [3, 1, 2, 3]))[0].layout == PADDED  # no prompt repeats


def test_packed_passes_where_the_model_packs_and_the_packed_rows_save_tokens(monkeypatch):
    monkeypatch.setattr(packing, "WIDTH_MULTIPLE", 4)
    b = ragged([6, 2, 4, 1, 3, 5], [8, 1, 3, 2, 1, 6])  # long-tail: padded 6 x 14 = 84 tokens
    planner = Planner(pack_sequences=True)
    (p,) = planner.plan(Model(), b)
    assert p.layout == PACKED and p.placement.width == 16 and p.placement.tokens() < 6 * 14
    assert planner.plan(Model(packs=False), b)[0].layout == PADDED  # masking of its own, FSDP, soft-capping
    even = ragged([6, 6, 6], [8, 8, 7])  # nearly equal lengths: one sequence a packed row, more tokens
    assert planner.plan(Model(), even)[0].layout == PADDED
    empty = ragged([6, 2], [0, 0])  # no response token to score
    assert planner.plan(Model(), empty)[0].layout == PADDED


@pytest.mark.parametrize("pack", [False, True])
def test_a_budget_cuts_passes_that_fit_it_and_cover_every_row_once(pack, monkeypatch):
    monkeypatch.setattr(packing, "WIDTH_MULTIPLE", 4)
    lengths = [8, 1, 3, 2, 1, 6, 7, 1, 1, 2]
    b = ragged([6, 2, 4, 1, 3, 5, 2, 6, 1, 3], lengths)
    plan = Planner(pack_sequences=pack, budget=budget(tokens=32)).plan(Model(), b)
    assert len(plan) > 1 and sorted(i for p in plan for i in p.rows) == list(range(len(b)))
    prompt, response = b["prompt_mask"].sum(1), b.response_lengths()
    for p in plan:
        padded = len(p.rows) * int(prompt[p.rows].max() + response[p.rows].max())
        assert (p.placement.tokens() if p.layout == PACKED else padded) <= 32 or len(p.rows) == 1
    assert {p.layout for p in plan} == ({PACKED, PADDED} if pack else {PADDED})
    # a micro-batch size: that many rows a pass, whatever the budget; the sync check's probe: one pass
    sized = Planner(budget=budget(tokens=32)).plan(Model(), b, size=4)
    assert [p.rows for p in sized] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [p.rows for p in Planner(budget=budget(size=3)).plan(Model(), b, one_pass=True)] == [list(range(10))]


def test_first_fit_runs_once_per_pass_in_the_planner_and_never_in_the_runner(monkeypatch):
    """A cut from the batch's packed rows places every sequence once; passes of a micro-batch size,
    once each; running the passes places nothing again."""
    monkeypatch.setattr(packing, "WIDTH_MULTIPLE", 4)
    calls = []
    first_fit = packing.first_fit
    monkeypatch.setattr(packing, "first_fit", lambda *a: calls.append(a) or first_fit(*a))
    model = disable_dropout(small_model("qwen2"))
    b = ragged([6, 2, 4, 1, 3, 5, 2, 6, 1, 3], [8, 1, 3, 2, 1, 6, 7, 1, 1, 2])
    want = Runner(Planner()).logprobs(model, b, 0.7, "policy")  # padded, one pass
    assert calls == []
    cut = Runner(Planner(pack_sequences=True, budget=budget(tokens=32)))
    cut.handle(model).can_pack()  # its probe, before the calls are counted
    got = cut.logprobs(model, b, 0.7, "policy")
    plan = cut.parts(model, b)
    assert len(calls) == 2 and len(plan) > 2  # once for the logprobs' passes, once for the plan above
    assert PACKED in {part.planned.layout for part in plan}
    mask = b["response_mask"].bool()
    assert (got[mask] - want[mask]).abs().max() < 1e-5
    calls.clear()
    sized = Runner(Planner(pack_sequences=True, budget=budget(size=4)))
    got = sized.logprobs(model, b, 0.7, "policy")
    assert len(calls) == 3  # passes of 4, 4 and 2 rows, each placed once
    assert (got[mask] - want[mask]).abs().max() < 1e-5


def test_the_runner_keeps_what_it_learns_in_a_handle_not_on_the_model():
    model = small_model("qwen2")
    runner = Runner(Planner(pack_sequences=True))
    handle = runner.handle(model)
    assert runner.handle(model) is handle and isinstance(handle, ModelHandle)
    assert handle.can_pack() and handle.head_split() is not None
    assert not [name for name in vars(model) if name.startswith("_hybridrl")]
    assert passes.runner_of(type("Ctx", (), {"passes": runner})()) is runner
