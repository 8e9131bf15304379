"""The batch that flows between the stages of a step.

Token layout (verl's): prompts left-padded to P, responses right-padded to T, so that
``input_ids = cat(prompts, responses)`` has every response starting at column P.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from hybridrl import distributed


@dataclass
class RolloutOutput:
    """Responses for P prompts x n samples, grouped by prompt: prompt i has rows i*n .. i*n+n-1."""

    token_ids: list[list[int]]  # sampled tokens, the stop token included when one was hit
    logprobs: list[list[float]]  # logprob of each sampled token under the sampling policy
    finish_reasons: list[str]  # "stop" or "length"
    #: per token, 1 where the policy sampled it and 0 where it did not (observation tokens of a
    #: multi-turn trajectory: attended to, never trained on, logprob 0); None: all sampled
    sampled_masks: list[list[int]] | None = None
    #: the policy updates the engine's weights held (set by the trainer's engine session, not the engine)
    policy_version: int | None = None
    #: per token, the weights that sampled it (engines that update in flight): the engine gives the
    #: count of its update_weights calls before the token, the engine session the policy version
    token_versions: list[list[int]] | None = None


@dataclass
class Batch:
    """Tensors of shape (B, ...) and lists of length B, addressed by name: ``batch["scores"]``.

    Standard entries: ``prompts`` (B, P) and ``prompt_mask``; ``responses`` (B, T) and
    ``response_mask`` (1 on tokens the policy sampled: what the loss trains on); for multi-turn
    trajectories ``response_attention_mask`` (1 on every response token, observations included:
    what attention sees; without it, ``response_mask``); ``rollout_logprobs``, ``old_logprobs``, ``ref_logprobs``,
    ``advantages`` (B, T); ``scores`` (B,); ``group_ids`` (B,) the prompt each response
    answers; lists ``prompt_text``, ``response_text``, ``answer``, ``metadata``,
    ``messages`` (the prompt's chat messages, for rewards with their own chat template),
    ``finish_reason``.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    lists: dict[str, list] = field(default_factory=dict)

    def __len__(self) -> int:
        for t in self.tensors.values():
            return t.shape[0]
        for v in self.lists.values():
            return len(v)
        return 0

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.lists

    def __getitem__(self, key: str):
        if key in self.tensors:
            return self.tensors[key]
        if key in self.lists:
            return self.lists[key]
        raise KeyError(f"Batch has no entry '{key}'. It has: {', '.join(sorted(self.keys()))}.")

    def __setitem__(self, key: str, value) -> None:
        n = len(self)
        size = value.shape[0] if isinstance(value, torch.Tensor) else len(value)
        if (self.tensors or self.lists) and size != n:
            raise ValueError(f"Batch entry '{key}' has {size} rows, the batch has {n}.")
        if isinstance(value, torch.Tensor):
            self.lists.pop(key, None)
            self.tensors[key] = value
        else:
            self.tensors.pop(key, None)
            self.lists[key] = list(value)

    def get(self, key: str, default=None):
        return self[key] if key in self else default

    def keys(self) -> list[str]:
        return [*self.tensors, *self.lists]

    def groups(self) -> int:
        """How many prompts (distinct ``group_ids``) the batch answers."""
        return int(torch.unique(self["group_ids"]).numel())

    def select(self, index: torch.Tensor | list[int]) -> Batch:
        index = torch.as_tensor(index, dtype=torch.long)
        idx = index.tolist()
        return Batch(
            {k: v[index.to(v.device)] for k, v in self.tensors.items()},
            {k: [v[i] for i in idx] for k, v in self.lists.items()},
        )

    def split(self, size: int) -> Iterator[Batch]:
        for start in range(0, len(self), size):
            yield self.select(list(range(start, min(start + size, len(self)))))

    def to(self, device: torch.device) -> Batch:
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, dict(self.lists))

    # -- the sequence view used by forward passes --------------------------------------

    @property
    def input_ids(self) -> torch.Tensor:  # (B, P + T)
        return torch.cat([self["prompts"], self["responses"]], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:  # (B, P + T)
        response = self.tensors.get("response_attention_mask", self.tensors.get("response_mask"))
        if response is None:
            raise KeyError(f"Batch has no entry 'response_mask'. It has: {', '.join(sorted(self.keys()))}.")
        return torch.cat([self["prompt_mask"], response], dim=1)

    def response_lengths(self) -> torch.Tensor:  # (B,) tokens after the prompt, observations included
        return self.tensors.get("response_attention_mask", self["response_mask"]).sum(-1)

    @classmethod
    def cat(cls, batches: list[Batch], pad_id: int) -> Batch:
        """The rows of ``batches`` one after the other; every batch has the same entries. Prompts
        are left-padded to the longest, response columns right-padded to the longest."""
        nonempty = [b for b in batches if len(b)] or batches[:1]
        keys = set(nonempty[0].keys())
        for b in nonempty[1:]:
            if set(b.keys()) != keys:
                raise ValueError(f"Batch.cat: entries differ: {sorted(keys ^ set(b.keys()))}.")
        P = max(b["prompts"].shape[1] for b in nonempty)
        T = max(b["responses"].shape[1] for b in nonempty)
        parts = [pad_responses(pad_prompts(b, P, pad_id), T, pad_id) for b in nonempty]
        return cls(
            {k: torch.cat([b.tensors[k].to(v.device) for b in parts]) for k, v in parts[0].tensors.items()},
            {k: [x for b in parts for x in b.lists[k]] for k in parts[0].lists},
        )

    @classmethod
    def from_rollout(cls, prompts: list[list[int]], out: RolloutOutput, n: int, pad_id: int) -> Batch:
        """Build the padded batch for ``prompts`` and ``n`` responses each."""
        if len(out.token_ids) != len(prompts) * n:
            raise ValueError(f"Rollout returned {len(out.token_ids)} responses for {len(prompts)} prompts x n={n}.")
        rows = [prompts[i // n] for i in range(len(out.token_ids))]
        P = max(len(p) for p in prompts)
        T = max(1, max(len(r) for r in out.token_ids))
        B = len(rows)
        prompt_ids = torch.full((B, P), pad_id, dtype=torch.long)
        prompt_mask = torch.zeros(B, P, dtype=torch.long)
        resp_ids = torch.full((B, T), pad_id, dtype=torch.long)
        resp_mask = torch.zeros(B, T, dtype=torch.long)
        logprobs = torch.zeros(B, T)
        attend = torch.zeros(B, T, dtype=torch.long) if out.sampled_masks is not None else None
        for b, (p, r, lp) in enumerate(zip(rows, out.token_ids, out.logprobs)):
            if p:
                prompt_ids[b, P - len(p) :] = torch.tensor(p)
                prompt_mask[b, P - len(p) :] = 1
            if r:
                resp_ids[b, : len(r)] = torch.tensor(r)
                resp_mask[b, : len(r)] = 1 if attend is None else torch.tensor(out.sampled_masks[b])
                logprobs[b, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
                if attend is not None:
                    attend[b, : len(r)] = 1
        batch = cls()
        batch["prompts"], batch["prompt_mask"] = prompt_ids, prompt_mask
        batch["responses"], batch["response_mask"] = resp_ids, resp_mask
        batch["rollout_logprobs"] = logprobs
        if attend is not None:
            batch["response_attention_mask"] = attend
        batch["group_ids"] = torch.arange(B) // n
        batch["finish_reason"] = out.finish_reasons
        if out.token_versions is not None:  # 0 past the response: read it through response_mask
            versions = torch.zeros(B, T, dtype=torch.long)
            for b, v in enumerate(out.token_versions):
                versions[b, : len(v)] = torch.tensor(v, dtype=torch.long)
            batch["token_versions"] = versions
        return batch


PROMPT_COLUMNS = ("prompts", "prompt_mask")


def pad_prompts(batch: Batch, width: int, pad_id: int) -> Batch:
    """``batch`` with its prompts left-padded to ``width`` columns (``prompts`` with ``pad_id``)."""
    P = batch["prompts"].shape[1]
    if P >= width:
        return batch
    tensors = dict(batch.tensors)
    for key, fill in zip(PROMPT_COLUMNS, (pad_id, 0)):
        v = tensors[key]
        tensors[key] = torch.cat([torch.full((v.shape[0], width - P), fill, dtype=v.dtype, device=v.device), v], 1)
    return type(batch)(tensors, dict(batch.lists))


def pad_responses(batch: Batch, width: int, pad_id: int) -> Batch:
    """``batch`` with its response columns right-padded to ``width``: every tensor of shape
    (B, T, ...) other than the prompts (``responses`` with ``pad_id``, the others with 0)."""
    T = batch["responses"].shape[1]
    if T >= width:
        return batch
    tensors = dict(batch.tensors)
    for key, v in batch.tensors.items():
        if key in PROMPT_COLUMNS or v.dim() < 2 or v.shape[1] != T:
            continue
        fill = pad_id if key == "responses" else 0
        extra = torch.full((v.shape[0], width - T, *v.shape[2:]), fill, dtype=v.dtype, device=v.device)
        tensors[key] = torch.cat([v, extra], dim=1)
    return type(batch)(tensors, dict(batch.lists))


def first_groups(batch: Batch, k: int) -> Batch:
    """The rows of the first ``k`` groups (``group_ids``, in order of appearance)."""
    ids = batch["group_ids"]
    first = list(dict.fromkeys(ids.tolist()))[:k]
    if len(first) == batch.groups():
        return batch
    keep = torch.isin(ids, torch.tensor(first, dtype=ids.dtype, device=ids.device))
    return batch.select(torch.nonzero(keep).squeeze(-1).cpu())


def with_branches(batch: Batch, pad_id: int) -> Batch:
    """The batch with a row for each earlier branch of its agents' episodes (the ``branches`` column:
    dicts of prompt, ids, logprobs, sampled, finish), after its own rows: the branch's tokens, masks,
    logprobs and finish reason, the rest its episode's (scores, group), and ``branch_row`` True, so
    group statistics count each episode once (:func:`hybridrl.functional.counted_rows`)."""
    if "branches" not in batch:
        return batch
    owners = [i for i, branches in enumerate(batch["branches"]) for _ in branches]
    branches = [b for bs in batch["branches"] for b in bs]
    main = Batch(dict(batch.tensors), {k: v for k, v in batch.lists.items() if k != "branches"})
    main["branch_row"] = torch.zeros(len(main), dtype=torch.bool)
    if not branches:
        return main
    out = RolloutOutput(*([b[k] for b in branches] for k in ("ids", "logprobs", "finish", "sampled")))
    own = Batch.from_rollout([b["prompt"] for b in branches], out, 1, pad_id)
    extra = main.select(owners)
    for key in own.keys():
        if key != "group_ids":
            extra[key] = own[key]
    if wide := [k for k, v in extra.tensors.items() if v.dim() > 1 and k not in own.keys()]:
        raise ValueError(f"with_branches: the batch has per-token entries besides the rollout's: {wide}")
    extra["branch_row"] = torch.ones(len(extra), dtype=torch.bool)
    return Batch.cat([main, extra], pad_id)


def padded_tokens(prompt: list[int], response: list[int], rows: list[int]) -> int:
    """Tokens a pass of ``rows`` runs, of rows with ``prompt[i]`` and ``response[i]`` tokens: each
    row at its longest prompt + its longest response (the shared padding is cut)."""
    return len(rows) * (max(prompt[i] for i in rows) + max(response[i] for i in rows))


def token_budget_split(batch: Batch, max_tokens: int, pass_cost: int | None = None) -> list[list[int]]:
    """Row indices of micro-batches whose padded size fits ``max_tokens``, longest rows first.

    The padded size of a micro-batch is its rows x (its longest prompt + its longest response),
    the columns left once padding shared by every row is cut. Rows go in order of decreasing
    length and are cut into runs of consecutive rows: of the cuts whose micro-batches fit the
    budget, the one with the fewest padded tokens plus ``pass_cost`` tokens a micro-batch (what
    a pass costs besides its tokens); a row longer than the budget is a micro-batch of its own.
    The default cost, the budget itself, cuts a pass off only where that saves more padded
    tokens than a whole pass holds, so most batches run in the fewest passes, with the least
    padding of those: on an H200 with compiled blocks, cutting a long-tail batch of 64
    responses by length at a cost of 4,096 tokens took longer (update 0.26-0.46 s) than one
    padded pass (0.165 s), see docs/performance.md. Found exactly by dynamic programming over
    the cut points (rows x rows steps, vectorised).
    """
    import numpy as np

    prompt = batch["prompt_mask"].sum(-1).tolist()
    response = batch.response_lengths().tolist()
    order = sorted(range(len(batch)), key=lambda i: (-(prompt[i] + response[i]), i))
    p = np.array([prompt[i] for i in order], dtype=np.int64)
    r = np.array([response[i] for i in order], dtype=np.int64)
    n, cost_of_pass = len(order), max_tokens if pass_cost is None else pass_cost
    best = np.zeros(n + 1)  # best[j]: the least cost of rows [0, j)
    start = np.zeros(n + 1, dtype=np.int64)  # where the last micro-batch of that cut starts
    for j in range(1, n + 1):
        # a micro-batch of rows [i, j) for every i < j: its width, its padded size, the cut's cost
        width = np.maximum.accumulate(p[:j][::-1])[::-1] + np.maximum.accumulate(r[:j][::-1])[::-1]
        rows = j - np.arange(j)
        size = rows * width
        cost = np.where((size <= max_tokens) | (rows == 1), best[:j] + size + cost_of_pass, np.inf)
        start[j] = int(np.argmin(cost))  # ties: the longest micro-batch
        best[j] = cost[start[j]]
    groups, j = [], n
    while j > 0:
        groups.append(order[start[j] : j])
        j = int(start[j])
    return groups[::-1]


# -- padding rows: every rank the same number of rows --------------------------------------


def even_out(batch: Batch, source: Batch) -> Batch:
    """Give this rank's batch as many rows as every other rank's.

    Ranks must run the same number of forward/backward passes (each one is collective under
    FSDP). A rank with fewer rows (an algorithm's filter dropped some) gets padding rows: copies
    of a row of ``batch`` (of ``source`` when it has none) with an empty ``response_mask``, a group
    of their own (negative ``group_ids``) and ``padding_row`` True, so they add nothing to a
    masked loss and count as no response in any normaliser. Identity on one process.
    """
    if distributed.world_size() == 1:
        return batch
    B = len(batch)
    rows = int(distributed.all_reduce([B], "max")[0])
    if B == rows:
        return batch
    k = rows - B
    pad = (batch if B else source).select([0] * k)
    pad["response_mask"] = torch.zeros_like(pad["response_mask"])
    pad["group_ids"] = -1 - torch.arange(k, dtype=pad["group_ids"].dtype)
    pad["padding_row"] = torch.ones(k, dtype=torch.bool)
    if B == 0:
        return pad
    batch = batch.select(list(range(B)))  # a copy, so that the flag column can be added
    if "padding_row" not in batch:
        batch["padding_row"] = torch.zeros(B, dtype=torch.bool)
    return Batch.cat([batch, pad], pad_id=0)  # the same widths: nothing is padded


def drop_padding(batch: Batch) -> Batch:
    """The batch without the padding rows of :func:`even_out`."""
    if "padding_row" not in batch:
        return batch
    return batch.select(torch.nonzero(~batch["padding_row"].bool().cpu()).squeeze(-1))


def real_rows(batch: Batch, branches: bool = True) -> int:
    """Rows of a batch that are not padding rows added by :func:`even_out`; with ``branches`` False,
    nor rows of agent episodes' earlier branches (:func:`with_branches`)."""
    keep = torch.ones(len(batch), dtype=torch.bool)
    for key in ("padding_row",) + (() if branches else ("branch_row",)):
        if key in batch:
            keep &= ~batch[key].bool().cpu()
    return int(keep.sum())
