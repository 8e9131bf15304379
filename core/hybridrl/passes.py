"""The pass planner and the pass runner: how each forward pass over a batch runs, and the one
object that runs them all.

Every forward pass of a run goes through a :class:`Runner`: the policy's old logprobs and the
reference's, the sync check's probe, the policy's loss passes and a critic's values and
value-loss passes (the last two through :func:`hybridrl.update.run_update`). Before it runs a
batch, the :class:`Planner` decides from the batch, the model (its :class:`ModelHandle`) and the
token budget (:class:`hybridrl.memory.MicroBatches`) where the passes cut and how each runs:

Where the passes cut:
  1. ``size`` (a model's own micro-batch size, else ``trainer.micro_batch_size``): that many
     consecutive rows a pass. The sync check's probe: all rows in one pass.
  2. Else a token budget (``trainer.micro_batch_tokens``: a number, or ``auto`` measured at the
     first pass): if the passes pack, the batch's sequences are placed once by first-fit in packed
     rows of the batch's width (rounded up to 128; at least the run's longest prompt and response
     where the strategy compiles, so that compiled blocks see one width) and each pass takes ``budget // width``
     consecutive packed rows; else rows longest first are cut with the least padding
     (:func:`hybridrl.batch.token_budget_split`). Under torchrun each rank then splits its most
     padded passes until it has as many as the rank with the most (each pass is collective).
  3. Else the whole batch in one pass.

How each pass runs:
  - **packed** (:mod:`hybridrl.packing`) where packing is on, the model can run packed rows
    (:meth:`ModelHandle.can_pack`: a language model's logits are its output layer's and its body
    keeps packed sequences apart, as its rows or as one row for flash attention; a critic's body
    does), every row's tokens are one span, the pass has response tokens, and its packed rows
    hold no more tokens than its padded rows would. The plan carries the pass's placement: first-fit
    runs once per pass (once for the batch where the cut placed it), never in the runner;
  - else **shared prompts** where they are on, the pass computes logprobs (not values), activation
    checkpointing is off and two rows have the same prompt (under torchrun: always); the plan carries
    the distinct prompts;
  - else **padded**.

``trainer.share_prompts: auto`` is on for a CPU device unless ``trainer.pack_sequences`` is true;
``trainer.pack_sequences: auto`` wherever prompts are not shared (a pass runs one of the two).
Both are resolved in :class:`Planner` and nowhere else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridrl import distributed, forward, packing
from hybridrl.batch import Batch, padded_tokens, token_budget_split
from hybridrl.devices import model_device_errors
from hybridrl.forward import ModelHandle, Outputs
from hybridrl.memory import MicroBatches, memory_errors, pass_fix, pass_sizes
from hybridrl.packing import Placement

PADDED, SHARED, PACKED = "padded", "shared prompts", "packed"


@dataclass
class Pass:
    """One forward pass of a plan: the rows of the batch it runs, and how."""

    rows: list[int]
    layout: str = PADDED
    placement: Placement | None = None  # PACKED: where first-fit put each row's sequence
    prompts: tuple[torch.Tensor, torch.Tensor] | None = None  # SHARED: forward.distinct_prompts


class Planner:
    """Decides the passes over a batch (see the module's docstring). ``share_prompts`` and
    ``pack_sequences``: the trainer's options (True, False or "auto"); ``budget``: the trainer's
    micro-batch size or token budget (None: one pass); ``device``: where the policy computes."""

    def __init__(
        self,
        share_prompts: bool | str = False,
        pack_sequences: bool | str = False,
        budget: MicroBatches | None = None,
        device: torch.device | None = None,
        width: int | None = None,
    ):
        self.width = width  # packed rows' least width (the strategy's pack_width), else each batch's own
        on_cpu = device is None or device.type == "cpu"
        self.share = on_cpu and pack_sequences is not True if share_prompts == "auto" else bool(share_prompts)
        self.pack = not self.share and (pack_sequences == "auto" or bool(pack_sequences))
        self.budget = budget

    @property
    def size(self) -> int | None:
        """trainer.micro_batch_size: responses a pass."""
        return self.budget.size if self.budget is not None else None

    def plan(self, handle: ModelHandle, batch: Batch, size: int | None = None, one_pass: bool = False) -> list[Pass]:
        """The passes over ``batch`` of the model of ``handle``: every row once."""
        T = batch["responses"].shape[1]
        ids, mask = batch.input_ids, batch.attention_mask
        pack = self.pack and T > 0 and handle.can_pack() and packing.spans(mask, T)
        cut = self._cut(batch, size, one_pass, pack)
        return [self._pass(handle, ids[g], mask[g], T, g, placed, pack) for g, placed in cut]

    def _cut(self, batch: Batch, size: int | None, one_pass: bool, pack: bool) -> list[tuple[list, Placement | None]]:
        """Row indices of each pass, and the placement of its sequences where the cut packed them."""
        size = None if one_pass else size or self.size
        tokens = None if one_pass or size or self.budget is None else self.budget.budget()
        if not tokens:
            return [(g, None) for g in consecutive(len(batch), size)]
        if pack:
            mask = batch.attention_mask
            cut = packing.cut(mask.sum(1).tolist(), self.pack_width(mask.shape[1]), tokens)
            cut = [(g, self._rows(p, tokens)) for g, p in cut]
        else:
            cut = [(g, None) for g in token_budget_split(batch, tokens)]
        if distributed.world_size() > 1:  # every rank the same number of passes, each cut by its own lengths
            passes = int(distributed.all_reduce([float(len(cut))], "max")[0])
            placed = {tuple(g): p for g, p in cut}
            cut = [(g, placed.get(tuple(g))) for g in split_widest(batch, [g for g, _ in cut], passes)]
        return cut

    def pack_width(self, tokens: int) -> int:
        """Tokens of the packed rows of a batch whose rows are ``tokens`` wide."""
        return max(packing.pack_width(tokens), self.width or 0)

    def _rows(self, placement: Placement, tokens: int | None = None) -> Placement:
        """At least two packed rows where the width is the run's (compiled blocks, whose one graph
        serves any number of rows but one: torch.compile specialises a size of 1), where the token
        budget of a pass (``tokens``) holds two."""
        two = self.width and placement.rows == 1 and (tokens is None or 2 * placement.width <= tokens)
        return dataclasses.replace(placement, rows=2) if two else placement

    def _pass(self, handle: ModelHandle, ids, mask, T: int, rows: list[int], placement, pack: bool) -> Pass:
        """How the pass of ``rows`` (``ids`` and ``mask`` (b, P + T)) runs."""
        if pack and bool(mask[:, ids.shape[1] - T :].any()):
            placement = placement or self._rows(packing.place(mask.sum(1).tolist(), self.pack_width(ids.shape[1])))
            if self.width or packing.saves(placement, mask, T):  # compiled blocks: packed rows of one width
                return Pass(rows, PACKED, placement=placement)
        if self.share and not handle.values and not handle.checkpointing():
            prompts = forward.distinct_prompts(ids, mask, T)
            if prompts is not None:
                return Pass(rows, SHARED, prompts=prompts)
        return Pass(rows)


def consecutive(rows: int, size: int | None) -> list[list[int]]:
    """Row indices of passes of ``size`` consecutive rows (default all)."""
    size = size or rows
    return [list(range(s, min(s + size, rows))) for s in range(0, rows, size)]


def split_widest(batch: Batch, groups: list[list[int]], passes: int) -> list[list[int]]:
    """``groups`` (rows longest first within each) cut further until there are ``passes``: each
    time the pass of the most padded tokens, into halves (neither pads more than it did). Needs
    ``passes`` <= rows."""
    prompt, response = batch["prompt_mask"].sum(-1).tolist(), batch.response_lengths().tolist()
    groups = list(groups)
    while len(groups) < passes:
        k = max(
            (k for k, g in enumerate(groups) if len(g) > 1), key=lambda k: padded_tokens(prompt, response, groups[k])
        )
        g = groups[k]
        groups[k : k + 1] = [g[: len(g) // 2], g[len(g) // 2 :]]
    return groups


@dataclass
class PassBatch(Batch):
    """The rows of one planned pass, and the pass: what a trained model's loss receives."""

    planned: Pass | None = None


class Runner:
    """Runs every forward pass of a run as its :class:`Planner` plans it, under the sharding
    strategy's autocast, on the inputs' device the strategy names; keeps a :class:`ModelHandle` for
    each model (what the passes learnt about it, and the strategy's fused output layer)."""

    def __init__(self, planner: Planner | None = None, strategy=None, device: torch.device | None = None):
        self.planner, self.strategy, self.device = planner or Planner(), strategy, device
        self._handles = weakref.WeakKeyDictionary()  # model -> its ModelHandle

    def handle(self, model: torch.nn.Module, values: bool = False) -> ModelHandle:
        """``model``'s handle, made at its first call (``values``: a value model, whose owner says so
        when it builds it)."""
        found = self._handles.get(model)
        if found is None:
            fused = self.strategy.fused_head_bytes if self.strategy is not None else None  # single's compile
            found = self._handles[model] = ModelHandle(model, fused, values)
        return found

    def parts(self, model, batch: Batch, size: int | None = None, one_pass: bool = False) -> list[PassBatch]:
        """The passes of ``model`` over ``batch`` (:meth:`Planner.plan`), each with its rows."""
        plan = self.planner.plan(self.handle(model), batch, size=size, one_pass=one_pass)
        return [PassBatch(part.tensors, part.lists, p) for p, part in ((p, batch.select(p.rows)) for p in plan)]

    @torch.no_grad()
    def logprobs(self, model, batch: Batch, temperature: float, component: str, one_pass: bool = False):
        """(B, T) logprobs of ``batch``'s responses under ``model`` at ``temperature``, without
        gradients, in the planned passes (``one_pass``: all rows at once, the sync check's probe),
        on the runner's device in the batch's order; ``component`` names the model in errors."""
        out = Outputs(temperature)
        parts = self.parts(model, batch, one_pass=one_pass)
        return self._stage(parts, f"the logprobs of the {component}", self.planner.size, self._inputs(model),
                           lambda part: self.pass_logprobs(model, part, out, component)[0])  # fmt: skip

    @torch.no_grad()
    def values(self, model, batch: Batch, component: str, size: int | None = None) -> torch.Tensor:
        """(B, T) values of a value model (:class:`ModelHandle`) before each response token, without
        gradients, in the planned passes (``size``: the model's own micro-batch size)."""
        self.handle(model, values=True)
        parts = self.parts(model, batch, size=size)
        return self._stage(parts, f"the values of the {component}", size or self.planner.size, self._inputs(model),
                           lambda part: self.pass_values(model, part, component))  # fmt: skip

    def pass_logprobs(self, model, part: Batch, out: Outputs, component: str = "policy"):
        """Logprobs (b, T) and entropies or None of the rows of one pass (a :class:`PassBatch`; a
        plain batch runs as one pass), with gradients where they are on (the update's loss)."""
        handle, inputs, T = self.handle(model), self._inputs(model), part["responses"].shape[1]
        p = self._planned(model, part)
        with model_device_errors(component, model, inputs, self.device or inputs), self._autocast():
            return run_logprobs(handle, part.input_ids.to(inputs), part.attention_mask.to(inputs), T, out, p)

    def pass_values(self, model, part: Batch, component: str = "critic") -> torch.Tensor:
        """Values (b, T) of a value model over the rows of one pass (as :meth:`pass_logprobs`)."""
        handle, inputs, T = self.handle(model, values=True), self._inputs(model), part["responses"].shape[1]
        p = self._planned(model, part)
        with model_device_errors(component, model, inputs, self.device or inputs), self._autocast():
            ids, mask = part.input_ids.to(inputs), part.attention_mask.to(inputs)
            if p.layout == PACKED:
                return forward.packed_values(handle, packing.pack(ids, mask, T, placement=p.placement), (len(ids), T))
            return forward.padded_values(model, ids, mask, T)

    def _planned(self, model, part: Batch) -> Pass:
        if isinstance(part, PassBatch) and part.planned is not None:
            return part.planned
        return self.planner.plan(self.handle(model), part, one_pass=True)[0]

    def _stage(self, parts: list[PassBatch], what: str, size, inputs, run: Callable) -> torch.Tensor:
        """``run(part)`` of each pass (out-of-memory errors naming ``what``), back in the batch's order."""
        outs = []
        for part in parts:
            with memory_errors(what, inputs, pass_sizes(part), pass_fix(part, size)):
                outs.append(run(part))
        out = torch.cat(outs)
        rows = torch.tensor([i for part in parts for i in part.planned.rows], device=out.device)
        return torch.empty_like(out).index_copy_(0, rows, out).to(self.device or out.device)

    def _inputs(self, model) -> torch.device:
        if self.strategy is not None:
            return self.strategy.input_device(model)  # the reference may live elsewhere (sharding.ref_device)
        return next(model.parameters()).device

    def _autocast(self):
        return self.strategy.autocast() if self.strategy is not None else contextlib.nullcontext()


def runner_of(ctx) -> Runner:
    """The run's pass runner (``ctx.passes``); one without a budget under a context without one (tests)."""
    return ctx.passes if ctx.passes is not None else Runner(strategy=ctx.strategy, device=ctx.device)


def run_logprobs(handle: ModelHandle, ids, mask, response_len: int, out: Outputs, p: Pass):
    """Logprobs (B, T) and entropies or None of the pass ``p`` over ``ids`` and ``mask`` (B, P + T)."""
    if p.layout == PACKED:
        packed = packing.pack(ids, mask, response_len, placement=p.placement)
        return forward.packed_logprobs(handle, packed, (len(ids), response_len), out)
    return forward.padded_logprobs(handle, ids, mask, response_len, out, p.prompts)


def response_logprobs(
    model: torch.nn.Module | ModelHandle,
    input_ids: torch.Tensor,  # (B, P + T)
    attention_mask: torch.Tensor,  # (B, P + T)
    response_len: int,  # T
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    share_prompts: bool = True,
    pack: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (B, T) of the response tokens (the last T columns) and entropies or None, in one
    pass planned as the trainer's are for ``share_prompts`` and ``pack`` (trainer.share_prompts,
    trainer.pack_sequences): for tests and tools that score a few rows. ``model``: a
    :class:`ModelHandle` (what it learns about the model is kept), or a module (probed afresh)."""
    handle = model if isinstance(model, ModelHandle) else ModelHandle(model)
    P = input_ids.shape[1] - response_len
    rows = Batch({"prompts": input_ids[:, :P], "prompt_mask": attention_mask[:, :P]})
    rows["responses"], rows["response_mask"] = input_ids[:, P:], attention_mask[:, P:]
    (p,) = Planner(share_prompts, pack).plan(handle, rows, one_pass=True)
    out = Outputs(temperature, with_entropy, entropy_grad)
    return run_logprobs(handle, input_ids, attention_mask, response_len, out, p)
