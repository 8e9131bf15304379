"""Packed forward passes: a pass's sequences laid end to end in rows of a fixed width, without padding.

A padded pass runs rows x (longest prompt + longest response) tokens; with long-tail response
lengths most of them are padding. Packing puts the attended tokens of several sequences one
after the other in a row of ``width`` tokens (first-fit decreasing: longest first, each into the
first row with room), each sequence with its own positions from 0, and gives no attention mask:
the model's attention keeps every sequence to its own tokens from the position ids that
restart. Eager, SDPA and flex attention build a block-diagonal causal mask in each row, so the
(R, W) rows run as they are. Flash attention reads the position ids only in a batch of one row
(its variable-length kernel, a sequence between each restart) and runs plain causal attention
over each row of a larger batch, so there the rows run end to end as one row (1, R * W), as
verl's ``use_remove_padding`` and OpenRLHF's ``--packing_samples`` give it packed sequences.
:func:`hybridrl.forward.packed_layout` finds the layout for a model once; a model that keeps
packed sequences apart in neither (masking of its own) runs padded passes. The logprobs are the
padded pass's up to rounding, gradients included.

First-fit runs once per pass: the planner (:mod:`hybridrl.passes`) places the sequences
(:func:`place`, or :func:`cut` for passes cut from the packed rows of a whole batch) and hands each
pass its :class:`Placement`; :func:`pack` lays the tokens out where the placement says.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

WIDTH_MULTIPLE = 128  # packed rows are a multiple of this many tokens wide: few shapes to compile


def pack_width(tokens: int) -> int:
    """Tokens of a packed row for sequences of up to ``tokens`` tokens."""
    return max(1, -(-tokens // WIDTH_MULTIPLE)) * WIDTH_MULTIPLE


@dataclass(frozen=True)
class Placement:
    """Where first-fit put a pass's sequences: the packed row of each, its first column there."""

    where: list[int]
    start: list[int]
    rows: int  # R packed rows
    width: int  # W tokens each

    def tokens(self) -> int:
        return self.rows * self.width


def place(lengths: list[int], width: int) -> Placement:
    """Sequences of ``lengths`` tokens into packed rows of ``width`` (:func:`first_fit`)."""
    where, start, rows = first_fit(lengths, width)
    return Placement(where, start, rows, width)


def cut(lengths: list[int], width: int, max_tokens: int) -> list[tuple[list[int], Placement]]:
    """Passes whose packed rows of ``width`` hold at most ``max_tokens`` tokens: the row indices of
    each and where its sequences lie in its packed rows.

    The rows are packed once (:func:`first_fit`), then consecutive packed rows go to a pass,
    ``max_tokens // width`` of them (one when a row is longer than the budget): every pass but
    the last has the same shape, so compiled blocks see two shapes a step instead of one for
    each pass."""
    where, start, rows = first_fit(lengths, width)
    members = [[] for _ in range(rows)]
    for i, r in enumerate(where):
        members[r].append(i)
    per_pass = max(1, max_tokens // width)
    out = []
    for s in range(0, rows, per_pass):
        group = sum(members[s : s + per_pass], [])
        placed = Placement(
            [where[i] - s for i in group], [start[i] for i in group], len(members[s : s + per_pass]), width
        )
        out.append((group, placed))
    return out


def first_fit(lengths: list[int], width: int) -> tuple[list[int], list[int], int]:
    """Sequences of ``lengths`` tokens into rows of ``width`` (first-fit decreasing): the row of
    each, its first column there, and the number of rows. Every length must be at most ``width``."""
    free = np.zeros(len(lengths), dtype=np.int64)  # tokens left in each row opened so far
    rows, where, start = 0, [0] * len(lengths), [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = np.flatnonzero(free[:rows] >= lengths[i])
        r = int(fits[0]) if len(fits) else rows
        if r == rows:
            free[r], rows = width, rows + 1
        where[i], start[i] = r, width - int(free[r])
        free[r] -= lengths[i]
    return where, start, rows


@dataclass
class Packed:
    """A pass of B padded rows laid out in packed rows, and where the response tokens went."""

    input_ids: torch.Tensor  # (R, W)
    position_ids: torch.Tensor  # (R, W) from 0 in each sequence and in each row's trailing padding
    predicting: torch.Tensor  # (M,) flat packed positions that predict the M response tokens
    rows: torch.Tensor  # (M,) the padded row of each response token
    columns: torch.Tensor  # (M,) its column among the T response columns
    tokens: torch.Tensor  # (M,) the response tokens


def spans(mask: torch.Tensor, response_len: int) -> bool:
    """Whether ``mask`` (B, P + T) in the batch's layout can be packed: each row's attended tokens
    are one span from the prompt into the response, and no response lacks a prompt token before it."""
    P = mask.shape[1] - response_len
    prompt, response = mask[:, :P].sum(1), mask[:, P:].sum(1)  # (B,)
    col = torch.arange(mask.shape[1], device=mask.device)
    span = (col >= P - prompt[:, None]) & (col < P + response[:, None])
    return torch.equal(span, mask.bool()) and not bool(((prompt == 0) & (response > 0)).any())


def saves(placement: Placement, mask: torch.Tensor, response_len: int) -> bool:
    """Whether the packed rows hold no more tokens than the padded pass of ``mask`` (B, P + T) runs
    (rows x (longest prompt + longest response)), so that a pass never takes more memory packed."""
    P = mask.shape[1] - response_len
    return placement.tokens() <= mask.shape[0] * int(mask[:, :P].sum(1).max() + mask[:, P:].sum(1).max())


def pack(
    ids: torch.Tensor,
    mask: torch.Tensor,
    response_len: int,
    width: int | None = None,
    placement: Placement | None = None,
) -> Packed | None:
    """``ids`` and ``mask`` (B, P + T) in the batch's layout (left-padded prompts, right-padded
    responses of T columns) laid out in packed rows as ``placement`` says. Without one, placed here
    in rows of ``width`` (default :func:`pack_width` of P + T), or None where packing does not apply
    (not :func:`spans`, or not what :func:`saves` tokens)."""
    B, L = ids.shape
    if placement is None:
        if not spans(mask, response_len):
            return None
        placement = place(mask.sum(1).tolist(), width or pack_width(L))
        if not saves(placement, mask, response_len):
            return None
    P = L - response_len
    prompt, response = mask[:, :P].sum(1), mask[:, P:].sum(1)  # (B,) attended tokens of each part
    lengths = prompt + response
    rows, width, device = placement.rows, placement.width, ids.device
    where = torch.tensor(placement.where, dtype=torch.long, device=device)
    base = where * width + torch.tensor(placement.start, dtype=torch.long, device=device)  # (B,)
    # every attended token: its padded row, its index k in the sequence, where it goes
    row = torch.repeat_interleave(torch.arange(B, device=device), lengths)
    k = torch.arange(len(row), device=device) - (torch.cumsum(lengths, 0) - lengths)[row]
    dst = base[row] + k
    packed = torch.zeros(rows * width, dtype=ids.dtype, device=device)
    packed[dst] = ids[row, P - prompt[row] + k]
    used = torch.zeros(rows, dtype=torch.long, device=device).index_add_(0, where, lengths)
    # (R,) tokens in each packed row: its padding counts on from 0 after them
    pos = (torch.arange(width, device=device)[None] - used[:, None]).reshape(-1)
    pos[dst] = k
    # response token t of row i is predicted by the sequence's token prompt_i + t - 1
    r_row = torch.repeat_interleave(torch.arange(B, device=device), response)
    t = torch.arange(len(r_row), device=device) - (torch.cumsum(response, 0) - response)[r_row]
    return Packed(
        input_ids=packed.view(rows, width),
        position_ids=pos.view(rows, width),
        predicting=base[r_row] + prompt[r_row] + t - 1,
        rows=r_row,
        columns=t,
        tokens=ids[r_row, P + t],
    )


def unpack(values: torch.Tensor, packed: Packed, shape: tuple[int, int]) -> torch.Tensor:
    """(M,) values of the response tokens -> (B, T), 0 where no response token is."""
    out = torch.zeros(shape, dtype=values.dtype, device=values.device)
    return out.index_put((packed.rows, packed.columns), values)
