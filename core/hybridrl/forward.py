"""The forward-pass kernels: a model's response logprobs (and entropies) and a critic's values over
one pass, laid out as :mod:`hybridrl.passes` planned it: padded, with shared prompts, or packed.

What the passes learn about a model once -- whether its logits are its output layer's
(:func:`head_split`), how its body keeps packed sequences apart (:func:`packed_layout`), the
budget of the fused output layer a sharding strategy compiles -- lives in a :class:`ModelHandle`,
an object of ours that the pass runner keeps for each model, never on the torch module.

Only response positions reach the output layer, and where the model allows it the output layer
runs in chunks of tokens whose vocabulary-sized logits are recomputed in the backward pass
instead of kept (:func:`chunked_head_logprobs`), so no (B, T, V) float32 tensor is materialised.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.utils.checkpoint

from hybridrl import distributed, packing
from hybridrl import functional as F
from hybridrl.models import LOW_PRECISION, is_checkpointing, position_ids

ROWS, ONE_ROW = "rows", "one row"  # the layouts of packed_layout
_UNKNOWN = object()


@dataclass(frozen=True)
class Outputs:
    """What a logprobs pass computes besides the logprobs of the sampled tokens at ``temperature``."""

    temperature: float = 1.0
    entropy: bool = False  # the entropy of each position's distribution too
    entropy_grad: bool = False  # ... with its gradient (an entropy bonus in the loss)


class ModelHandle:
    """A model as the forward passes run it, and what they learn about it once.

    ``fused_head_bytes``: the sharding strategy's compiled, fused output layer (sharding.compile),
    keeping a pass's logits up to that many bytes for the backward pass; None: the eager chunks.
    ``values``: the model is a value model (a critic): ``model(input_ids=, attention_mask=,
    position_ids=)`` gives (B, L) values, and ``model.body`` is the transformer whose hidden states
    they read (the packing probe runs it; a value model without one runs padded passes).
    """

    def __init__(self, model: torch.nn.Module, fused_head_bytes: int | None = None, values: bool = False):
        self.model, self.fused_head_bytes, self.values = model, fused_head_bytes, values
        self._split = _UNKNOWN
        self._layouts: dict = {}  # the body's attention implementation -> its packed_layout

    def head_split(self):
        """(body, output layer) where the logits are ``head(body(...).last_hidden_state)``, else None;
        probed once (:func:`head_split`)."""
        if self._split is _UNKNOWN:
            self._split = None if self.values else head_split(self.model)
        return self._split

    def plain_head(self) -> None:
        """Take the logits from the model's own forward pass, as for models that transform them."""
        self._split = None

    def packed_layout(self) -> str | None:
        """``ROWS`` or ``ONE_ROW`` (:func:`packed_layout`), probed once per attention implementation;
        None: the passes run padded."""
        body = self._body()
        if body is None:
            return None
        attention = getattr(getattr(body, "config", None), "_attn_implementation", None)
        if attention not in self._layouts:
            self._layouts[attention] = packed_layout(body)
        return self._layouts[attention]

    def can_pack(self) -> bool:
        """Whether the passes can run packed: a language model's logits are its output layer's and its
        body keeps packed sequences apart; a value model's body does."""
        return self.packed_layout() is not None

    def checkpointing(self) -> bool:
        """Activation checkpointing is on: recomputed layers cannot fill a KV cache (no shared prompts)."""
        return is_checkpointing(self.model)

    def _body(self):
        from torch.distributed.fsdp import FSDPModule

        if not self.values:
            split = self.head_split()
            return split[0] if split is not None else None
        # a sharded value model gathers its weights in its root's forward only, not in the probe's
        return None if isinstance(self.model, FSDPModule) else getattr(self.model, "body", None)


# -- padded passes (with shared prompts) ---------------------------------------------------


def padded_logprobs(handle: ModelHandle, input_ids, attention_mask, response_len: int, out: Outputs, prompts=None):
    """Logprobs (B, T) of the response tokens (the last T columns of ``input_ids`` (B, P + T)), and
    entropies (B, T) or None, over padded rows.

    Columns that are padding in every row (the prompts' common left padding, the responses' common
    right padding) are cut before the forward pass; their outputs are 0. ``prompts``: the pass's
    distinct prompts (:func:`distinct_prompts`), each run once (:func:`predicting_outputs`).
    """
    T = response_len
    used = attention_mask.any(0)  # (P + T,) columns some row attends to
    first = int(used.int().argmax())
    tail = int(used[-T:].flip(0).int().argmax()) if T and used[-T:].any() else max(T - 1, 0)  # unused responses
    kept = T - tail  # at least one column when T > 0, so that the output stays part of the graph
    ids = input_ids[:, first : input_ids.shape[1] - tail]
    mask = attention_mask[:, first : attention_mask.shape[1] - tail]
    tokens = ids[:, ids.shape[1] - kept :]
    split = handle.head_split() if kept else None
    if split is not None:
        body, head = split
        hidden = predicting_outputs(lambda **kw: _hidden(body, kw), ids, mask, kept, prompts)
        logprobs, entropy = chunked_head_logprobs(
            hidden, head, tokens, out.temperature, out.entropy, out.entropy_grad, **_fused(handle)
        )
    else:
        logits = predicting_outputs(lambda **kw: _logits(handle.model, kw), ids, mask, kept, prompts)
        logits = logits / out.temperature
        logprobs = F.logprobs_from_logits(logits, tokens)  # (B, kept)
        entropy = None
        if out.entropy:
            with torch.set_grad_enabled(out.entropy_grad and torch.is_grad_enabled()):
                entropy = F.entropy_from_logits(logits)
    pad = (0, tail)
    return torch.nn.functional.pad(logprobs, pad), (torch.nn.functional.pad(entropy, pad) if out.entropy else None)


def distinct_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_len: int):
    """(one row of each distinct prompt (U,), each row's prompt among them (B,)) of a pass of
    ``input_ids`` and ``attention_mask`` (B, P + T), comparing the prompts' columns that some row
    attends to; None where no two rows share a prompt (or no row has one). Under torchrun rows share
    their prompts in any case: the ranks of a sharded model run the same forward passes."""
    B, P = input_ids.shape[0], input_ids.shape[1] - response_len
    used = attention_mask[:, :P].any(0)  # (P,)
    if not response_len or not used.any():
        return None
    first = int(used.int().argmax())
    prompt = torch.cat([input_ids[:, first:P], attention_mask[:, first:P]], 1)
    unique, inverse = torch.unique(prompt, dim=0, return_inverse=True)
    if len(unique) == B and distributed.world_size() == 1:
        return None
    rows = torch.zeros(len(unique), dtype=torch.long, device=inverse.device)
    return rows.scatter_(0, inverse, torch.arange(B, device=inverse.device)), inverse


def predicting_outputs(forward, ids: torch.Tensor, mask: torch.Tensor, kept: int, prompts=None) -> torch.Tensor:
    """The outputs at the positions that predict the last ``kept`` tokens of ``ids`` (B, L): (B, kept, ...).

    ``forward(input_ids=, attention_mask=, position_ids=, keep=k, ...)`` -> (outputs at the last k
    positions, the KV cache). With ``prompts`` (:func:`distinct_prompts`), rows whose prompt is the
    same, such as the n samples of a GRPO group, run the prompt once: its keys and values are copied
    to each of its rows, which then run their responses on top. The result is the full forward
    pass's up to rounding, gradients included (the copies' gradients add up in the prompt's), with
    the prompt's tokens computed once per distinct prompt instead of once per response (the
    shared-prefix forward of Prefix Grouper, arXiv:2506.05433).
    """
    P = ids.shape[1] - kept
    pos = position_ids(mask)
    if prompts is None or P <= 0:
        return forward(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, keep=kept + 1)[0][:, :-1]
    rows, inverse = (t.to(ids.device) for t in prompts)
    last, cache = forward(
        input_ids=ids[rows, :P], attention_mask=mask[rows, :P], position_ids=pos[rows, :P], use_cache=True, keep=1
    )
    cache.reorder_cache(inverse)
    out, _ = forward(
        input_ids=ids[:, P:],
        attention_mask=mask,
        position_ids=pos[:, P:],
        past_key_values=cache,
        use_cache=True,
        keep=kept,
    )
    # the prompt's last position predicts the first response token; the response's last predicts nothing
    return torch.cat([last[inverse], out[:, :-1]], 1)


def _hidden(body, kwargs):
    keep = kwargs.pop("keep")
    out = body(**kwargs)
    return out.last_hidden_state[:, -keep:], out.past_key_values


def _logits(model, kwargs):
    keep = kwargs.pop("keep")
    out = model(**kwargs, logits_to_keep=keep)
    return out.logits[:, -keep:], out.past_key_values


def padded_values(model: torch.nn.Module, input_ids, attention_mask, response_len: int) -> torch.Tensor:
    """A value model's values (B, T) of the states before each response token, in float32.

    Position P + t - 1 has read the prompt and response tokens before t, so its output is V(s_t);
    like the policy's logprobs, the T outputs before the last are taken.
    """
    values = model(input_ids=input_ids, attention_mask=attention_mask)
    return values[:, -response_len - 1 : -1].float()


# -- packed passes -------------------------------------------------------------------------


def packed_logprobs(handle: ModelHandle, packed: packing.Packed, shape: tuple[int, int], out: Outputs):
    """:func:`padded_logprobs` of a pass laid out in packed rows (:func:`hybridrl.packing.pack`):
    (B, T) logprobs and entropies or None, 0 outside the responses."""
    body, head = handle.head_split()
    # no KV cache: transformers finds the packed sequences from the positions only without one
    hidden = _packed_outputs(
        handle, packed, lambda ids, pos: body(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
    )
    logprobs, entropy = chunked_head_logprobs(
        hidden[None], head, packed.tokens[None], out.temperature, out.entropy, out.entropy_grad, **_fused(handle)
    )
    entropy = packing.unpack(entropy[0], packed, shape) if out.entropy else None
    return packing.unpack(logprobs[0], packed, shape), entropy


def packed_values(handle: ModelHandle, packed: packing.Packed, shape: tuple[int, int]) -> torch.Tensor:
    """:func:`padded_values` of a pass laid out in packed rows: (B, T), 0 outside the responses."""
    values = _packed_outputs(handle, packed, lambda ids, pos: handle.model(input_ids=ids, position_ids=pos))
    return packing.unpack(values.float(), packed, shape)


def _packed_outputs(handle: ModelHandle, packed: packing.Packed, run) -> torch.Tensor:
    """``run(ids, positions)`` (r, w) -> (r, w, ...) over the packed rows in the model's layout, at
    the M positions that predict the response tokens: (M, ...)."""
    ids, pos = packed.input_ids, packed.position_ids  # (R, W)
    if handle.packed_layout() == ONE_ROW:
        ids, pos = ids.reshape(1, -1), pos.reshape(1, -1)  # (1, R * W)
    outputs = run(ids, pos)
    # (R, W) and (1, R * W) flatten alike
    return outputs.reshape(-1, *outputs.shape[2:])[packed.predicting]


# -- the output layer ----------------------------------------------------------------------


def _fused(handle: ModelHandle) -> dict:
    keep = handle.fused_head_bytes
    return {"fused": keep is not None, "keep_bytes": keep}


def chunked_head_logprobs(
    hidden: torch.Tensor,  # (B, T, H) the body's output at the positions that predict the tokens
    head: torch.nn.Linear,  # H -> V
    tokens: torch.Tensor,  # (B, T)
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk_bytes: int = 2**30,
    fused: bool = False,
    keep_bytes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (B, T) of ``tokens`` and optionally entropies, from hidden states, in chunks.

    Each chunk of tokens holds at most ``chunk_bytes`` of float32 logits. Under autograd, when
    the logits of all chunks take more than ``keep_bytes`` (default: one chunk), each chunk is
    checkpointed, so its backward pass recomputes the logits rather than storing them (on an
    H200, 7% more update time for 36 GiB less memory with a 150k vocabulary and 16k response
    tokens). ``fused``: torch.compile fuses the output layer's cast to float32, temperature,
    log-sum-exp, gather and entropy into one pass over the logits, and their backward into another,
    keeping the logits in the compute dtype (bf16 under autocast) instead of float32 copies
    (sharding.compile; ``keep_bytes`` is then sharding.keep_logits_gib).
    """
    B, T, H = hidden.shape
    flat, targets = hidden.reshape(B * T, H), tokens.reshape(B * T)
    size = max(1, chunk_bytes // (4 * head.out_features))
    if keep_bytes is None:  # logits that fit one chunk are kept as usual
        recompute = B * T > size
    else:
        recompute = B * T * head.out_features * _compute_dtype(hidden).itemsize > keep_bytes
    recompute = recompute and torch.is_grad_enabled()
    if fused and not recompute:
        size = B * T  # one kernel over all tokens
    step = _fused_chunk() if fused else _head_chunk
    logprobs, entropies = [], []
    for start in range(0, B * T, size):
        x, y = flat[start : start + size], targets[start : start + size]
        # one compiled graph for every number of tokens: torch.compile gives 0 and 1 graphs of their
        # own, so a chunk of one token (a pass of one 1-token response) runs as two, the second dropped
        one = fused and len(y) == 1
        if one:
            x, y = x.repeat(2, 1), y.repeat(2)
        if fused:
            for t in (x, y):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        fn = functools.partial(step, temperature, with_entropy, entropy_grad and torch.is_grad_enabled())
        args = (x, y, head.weight, head.bias)
        lp, ent = torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False) if recompute else fn(*args)
        logprobs.append(lp[:1] if one else lp)
        entropies.append(ent[:1] if one and ent is not None else ent)
    entropy = torch.cat(entropies).reshape(B, T) if with_entropy else None
    return torch.cat(logprobs).reshape(B, T), entropy


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _head_chunk(temperature: float, with_entropy: bool, entropy_grad: bool, hidden, tokens, weight, bias):
    """(n, H), (n,) -> logprobs (n,), entropies (n,) | None."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature  # (n, V)
    lse = logits.logsumexp(-1)
    logprobs = logits.gather(-1, tokens[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logprobs, None
    with torch.set_grad_enabled(entropy_grad):
        entropy = lse - (torch.softmax(logits, -1) * logits).sum(-1)
    if not entropy_grad:
        entropy = entropy.detach()
    return logprobs, entropy


@functools.cache
def _fused_chunk():
    # its callers mark the number of tokens dynamic; the vocabulary and hidden size stay static
    return torch.compile(_head_chunk)


# -- what a model allows: probed once per handle --------------------------------------------


def head_split(model: torch.nn.Module):
    """(body, output layer) when ``model``'s logits are exactly ``head(body(...).last_hidden_state)``,
    else None.

    Checked on a two-token input, so models that scale or soft-cap their logits (Gemma 2, Cohere,
    Granite...) and models sharded with FSDP (whose root gathers the output layer's weights only in
    its own forward) use the plain forward pass instead. Compiled blocks run eagerly here, so that
    this probe of one row neither compiles a graph of its own nor takes one of the recompilations
    torch.compile allows a function.
    """
    from torch.distributed.fsdp import FSDPModule

    body = getattr(model, "base_model", model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(model, FSDPModule) or body is model or not isinstance(head, torch.nn.Linear):
        return None
    device = head.weight.device
    ids = torch.tensor([[0, 1]], device=device)
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(2, device=device)[None])
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), _eager():  # called as the padded pass calls them
            want = model(**kwargs, use_cache=False).logits[:, -1].float()
            got = head(body(**kwargs, use_cache=False).last_hidden_state[:, -1]).float()
    except Exception:  # noqa: BLE001 - an unusual body signature: the plain path works for every model
        return None
    finally:
        model.train(was_training)
    same = torch.allclose(want, got, rtol=1e-3, atol=1e-3 * float(want.abs().max().clamp(min=1)))
    return (body, head) if same else None


def _eager():
    """Inside it, compiled functions and modules run their Python code, compiling nothing."""
    stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    return stance("force_eager") if stance else contextlib.nullcontext()


def packed_layout(body: torch.nn.Module) -> str | None:
    """How ``body`` (a transformers base model) runs a pass's packed rows (R, W) so that each
    sequence attends only to itself, or None where it cannot (padded passes):

    - ``ROWS``: the rows as they are. Eager, SDPA and flex attention build a block-diagonal
      causal mask for each row from its position ids that restart.
    - ``ONE_ROW``: the rows end to end as one row (1, R * W). Flash attention (flash_attention_2,
      _3, hub kernels) runs its variable-length kernel, sequence boundaries taken from the
      position ids, only for a batch of one row; over a batch of several rows it runs plain
      causal attention in each row, where a sequence sees those packed before it.

    ``ROWS`` where both hold: attention that scores a row's every pair of tokens would take R times
    as long over one row. The probe: two packed rows of two sequences each (the second with a token
    of trailing padding, as :func:`hybridrl.packing.pack` lays them out) must give each sequence its
    values alone, first without autocast, then (float32 weights whose kernel refuses them:
    flash-attn takes 16-bit inputs only) under bfloat16 autocast, as the passes run. Two rows,
    because flash attention keeps one row's sequences apart and not those of two. A sequence that
    sees another changes by about its own size; the tolerance is the weights' rounding. A body of a
    model with its own masking passes neither.
    """
    weight = next(body.parameters())
    device = weight.device
    low = weight.dtype in LOW_PRECISION
    was_training = body.training
    body.eval()
    try:
        try:
            return _probe_packing(body, torch.autocast(device.type, enabled=False), 2e-2 if low else 1e-3)
        except Exception:  # noqa: BLE001 - a body that refuses these arguments runs padded passes
            if low:
                return None
        try:
            return _probe_packing(body, torch.autocast(device.type, dtype=torch.bfloat16), 2e-2)
        except Exception:  # noqa: BLE001
            return None
    finally:
        body.train(was_training)


def _probe_packing(body: torch.nn.Module, precision, tol: float) -> str | None:
    device = next(body.parameters()).device
    sequences = [[3, 5, 7], [11, 13], [13, 7], [5, 11]]
    ids = torch.tensor([[3, 5, 7, 11, 13], [13, 7, 5, 11, 0]], device=device)  # (2, 5)
    pos = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 0]], device=device)  # (2, 5)
    real = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]], device=device).bool()  # (2, 5) not padding

    def hidden(x, positions=None):  # (r, w) -> (r, w, H)
        return body(input_ids=x, position_ids=positions, use_cache=False).last_hidden_state

    with torch.no_grad(), _eager(), precision:
        want = torch.cat([hidden(torch.tensor([s], device=device))[0] for s in sequences]).float()
        for layout, shape in ((ROWS, ids.shape), (ONE_ROW, (1, ids.numel()))):
            got = hidden(ids.reshape(shape), pos.reshape(shape)).reshape(*ids.shape, -1)[real].float()
            if torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max().clamp(min=1))):
                return layout
    return None
