"""The ``hf`` engine's fast path on the static KV cache: the engine copy's dtype, what it changes in
that copy (attention that reads a grouped-query cache in place, projections that read one input
fused into one matrix multiplication), the decoding loop's state on the device
(:class:`DecodeState`), its CUDA graphs (:func:`capturing`, :class:`GraphStats`) and how it samples
a token as ``generate`` does. The plain path, ``generate`` on the dynamic cache: hf_generate.py."""

from __future__ import annotations

import contextlib
import functools
import time
import warnings

import torch

from hybridrl.compile import pays_back
from hybridrl.models import DTYPES

GROUPED_ATTENTION = "hybridrl_grouped_decode"

# compile: auto compiles decoding on CUDA when the run plans at least this many response tokens (steps x
# responses x max_tokens). Eager decoding replays CUDA graphs too (2026-12-03, H200, the 0.5B shape, 64 x 256
# tokens a step: a 0.90 s rollout, 8.33 s without graphs); compiled, that rollout took 0.47 s (2026-11-30), so
# about a minute of compiling pays back after some 140 such steps, 2.3M tokens. (Before eager graphs, with
# SmolLM2-135M at 32 x 8 x 32 tokens, compiling saved 1.16 s a step and paid back after 500k-900k tokens.)
COMPILE_PAYS_TOKENS = 2_000_000


def compile_pays(choice: str, ctx, options: str = "") -> bool:
    """Whether rollout.compile ``choice`` compiles decoding; auto: on CUDA when the run plans at least
    ``COMPILE_PAYS_TOKENS`` response tokens (steps x responses per call x max tokens), or has no
    planned end (``ctx.steps`` None), or an earlier run of the model with these engine ``options`` and
    sampling settings saved its step precompiled (a second run); said once where it does not."""
    planned = ctx.steps * (ctx.responses_per_call or 0) * (ctx.response_tokens or 0) if ctx.steps else None
    counted = "response tokens (trainer.steps x responses x rollout.max_tokens)"
    sampling = ctx.sampling and ctx.sampling.model_dump_json(exclude={"n", "stop"})  # a variant per setting
    key = (options, bool(ctx.lora), sampling)
    return pays_back(choice, "rollout.compile", ctx, planned, COMPILE_PAYS_TOKENS, counted, key)


def keeps_prompt_width(compiled: bool, static: bool, cuda: bool, graph_tokens: int) -> bool:
    """Whether decoding pads every call's prompts to the widest bucket so far (from the data's longest
    prompt on): compiled decoding, so that shorter prompts compile nothing new, and eager decoding in
    CUDA graphs, whose loop keeps its graphs only while the cache keeps its length (a new width
    rebuilds the loop: each of its sizes runs once without graphs and captures them again)."""
    return compiled or (static and cuda and graph_tokens > 0)


@contextlib.contextmanager
def capturing(graph, pool):
    """The work queued inside captured into ``graph`` in the memory ``pool``, on a side stream: what
    ``torch.cuda.graph`` does without emptying torch's caches of device and pinned host memory
    first (and, where configured, collecting garbage), which a capture of a few decoding steps
    does not need and which made the next passes allocate their memory again."""
    stream = _capture_stream()
    torch.cuda.synchronize()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        try:
            graph.capture_begin(pool=pool)
            yield graph
        except BaseException:
            with contextlib.suppress(RuntimeError):  # ends the failed capture; the body's error says why
                graph.capture_end()
            leave_capture_mode()
            raise
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)


def leave_capture_mode() -> None:
    """An empty capture, begun and ended on the current (side) stream, after one that failed. A capture
    the device invalidated (a host sync inside it) fails at its end before torch's epilogue, which
    leaves the CUDA generator in capture mode: every random draw outside a capture then raised
    "Offset increment outside graph capture encountered unexpectedly", so decoding could not go on
    without graphs. The empty capture's epilogue takes the generator out of capture mode."""
    empty = torch.cuda.CUDAGraph()
    with warnings.catch_warnings(), contextlib.suppress(RuntimeError):
        warnings.simplefilter("ignore")  # "The CUDA Graph is empty"
        empty.capture_begin()
        empty.capture_end()


@functools.cache
def _capture_stream():
    return torch.cuda.Stream()


def engine_dtype(choice: str, policy_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of the engine's copy: ``choice``, or for 'auto' bfloat16 on a CUDA GPU that
    supports it when the policy is float32, else the policy's."""
    if choice != "auto":
        return DTYPES[choice]
    if policy_dtype == torch.float32 and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return policy_dtype


# compact_rows: a loop keeps at least a sixteenth of a call's rows, and on a GPU at least 64: there
# a decoding step of 64 rows of the 0.5B shape took as long as one of fewer (H200), so a smaller
# loop would only add a compiled step and its CUDA graphs
COMPACT_FRACTION, GPU_MIN_ROWS = 16, 64


def row_floor(device: torch.device) -> int:
    """The fewest rows compaction moves to: GPU_MIN_ROWS on a GPU, else 1."""
    return GPU_MIN_ROWS if device.type == "cuda" else 1


def compacted_rows(rows: int, running: int, call_rows: int, floor: int) -> int:
    """The rows of the loop to go on in when ``running`` rows of a loop of ``rows`` have not ended,
    in a call of ``call_rows``: halved while the running rows fill at most half, and not below
    ``call_rows`` / 16 or ``floor``; ``rows`` itself to stay."""
    least = max(1, call_rows // COMPACT_FRACTION, floor)
    while rows % 2 == 0 and running <= rows // 2 and rows // 2 >= least:
        rows //= 2
    return rows


def steps_between_checks(tokens: int, every: int) -> list[int]:
    """The runs of decoding steps of a call of ``tokens`` response tokens that runs to its end: the
    prompts' forward pass gives the first token, then each run goes up to the next check of ended
    sequences (every ``every`` tokens), the last up to ``tokens``."""
    runs, recorded = [], 1
    while recorded < tokens:
        runs.append(min(every - recorded % every, tokens - recorded))
        recorded += runs[-1]
    return runs


def grouped_decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' SDPA attention, except for decoding (one query token per sequence): there the
    query heads that share a KV head attend to the cache as it is. With a mask, transformers'
    SDPA path first copies every KV head once per query head (the whole static cache, keys and
    values, in every layer at every token), which was half the GPU time of decoding."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    (B, H, q_len, D), kv_heads = query.shape, key.shape[1]
    if q_len != 1 or dropout or kwargs.get("softcap") or kwargs.get("s_aux") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    q = query.view(B, kv_heads, H // kv_heads, D)
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * (D**-0.5 if scaling is None else scaling)
    if attention_mask is not None:  # (B, 1, 1, L): boolean (attend) or additive
        mask = attention_mask[:, :, -1:, : key.shape[2]]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    out = torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)  # (B, KV heads, group, D)
    return out.reshape(B, 1, H, D), None


def use_grouped_decode_attention(model) -> bool:
    """Switch an SDPA model to :func:`grouped_decode_attention`; False where it cannot be."""
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        if model.config._attn_implementation != "sdpa":
            return False
        AttentionInterface.register(GROUPED_ATTENTION, grouped_decode_attention)
        AttentionMaskInterface.register(GROUPED_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
        model.set_attn_implementation(GROUPED_ATTENTION)
    except (ImportError, AttributeError, ValueError, KeyError):
        return False
    return True


FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # linears that read one input


class FusedGroup(torch.nn.Module):
    """Linear layers that read the same input, as one matrix multiplication.

    Holds their weights (and biases) concatenated; each layer's own parameters become views of
    them, so that the state dict keeps its names and loading a weight in place updates the
    concatenation. The first layer called computes every output and keeps them until the
    others of the group have taken theirs, for that same input tensor (any other input is
    computed on its own).
    """

    def __init__(self, linears: list[torch.nn.Linear]):
        super().__init__()
        self.register_buffer("weight", torch.cat([lin.weight for lin in linears]), persistent=False)
        has_bias = linears[0].bias is not None
        self.register_buffer("bias", torch.cat([lin.bias for lin in linears]) if has_bias else None, persistent=False)
        self.bounds, start = [], 0
        for lin in linears:
            rows = lin.out_features
            self.bounds.append((start, start + rows))
            lin.weight = torch.nn.Parameter(self.weight[start : start + rows], requires_grad=False)
            if has_bias:
                lin.bias = torch.nn.Parameter(self.bias[start : start + rows], requires_grad=False)
            start += rows
        self.input = self.output = None
        self.pending = 0

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if self.input is not x:
            self.input, self.output = x, torch.nn.functional.linear(x, self.weight, self.bias)
            self.pending = len(self.bounds)
        lo, hi = self.bounds[index]
        out = self.output[..., lo:hi]
        self.pending -= 1
        if self.pending == 0:  # every layer of the group has its output: keep nothing alive
            self.input = self.output = None
        return out


class FusedPart(torch.nn.Module):
    """One linear layer of a :class:`FusedGroup`; its parameters are views of the group's."""

    def __init__(self, linear: torch.nn.Linear, group: FusedGroup, index: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        object.__setattr__(self, "group", group)  # not a submodule: the parent owns it once
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.part(self.index, x)


def fuse_projections(model: torch.nn.Module) -> int:
    """Compute each attention's q/k/v projections, and each MLP's gate and up projections, as one
    matrix multiplication (:data:`FUSED_GROUPS`, the Llama/Qwen/Mistral names); in decoding, with
    a few dozen rows, each multiplication costs about the same whatever its width. Returns the
    number of groups fused; modules whose layers differ in input size, dtype or bias are left."""
    fused = 0
    for module in list(model.modules()):
        for names in FUSED_GROUPS:
            linears = [getattr(module, n, None) for n in names]
            if not all(type(lin) is torch.nn.Linear for lin in linears):
                continue
            first = linears[0]
            if any(
                lin.in_features != first.in_features
                or lin.weight.dtype != first.weight.dtype
                or (lin.bias is None) != (first.bias is None)
                for lin in linears
            ):
                continue
            group = FusedGroup(linears)
            module.add_module(f"hybridrl_fused_{names[0]}", group)
            for i, (name, lin) in enumerate(zip(names, linears)):
                setattr(module, name, FusedPart(lin, group, i))
            fused += 1
    return fused


class GraphStats:
    """What a step's decoding did besides replaying CUDA graphs, for ``hf/graph_*``: loops of a new
    number of rows made (``compact_rows``), first runs of a number of steps (no graph yet: warm-up)
    and captures, with the host's seconds in each, so that a slow step says where it went."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.loops, self.warm, self.captures, self.warm_s, self.capture_s = 0, 0, 0, 0.0, 0.0

    def warmed(self, start: float) -> None:
        self.warm, self.warm_s = self.warm + 1, self.warm_s + time.perf_counter() - start

    def captured(self, start: float) -> None:
        self.captures, self.capture_s = self.captures + 1, self.capture_s + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        out = {"hf/graph_new_loops": self.loops, "hf/graph_warmups": self.warm, "hf/graph_captures": self.captures}
        out |= {"hf/graph_warmup_s": self.warm_s, "hf/graph_capture_s": self.capture_s}
        self.reset()  # read once per step
        return out


class DecodeState:
    """The decoding loop's state for one shape (rows, prompt and response lengths) on the device:
    the static KV cache, the tokens and logprobs so far, which rows have ended, the next token and
    the index of the last one recorded. Every call of that shape reuses them in place, at fixed
    addresses, so that the CUDA graphs captured over them (``graphs``, one per number of steps and
    sampling settings, in the loop's own memory pool) replay from call to call."""

    def __init__(self, model, batch: int, prompt: int, tokens: int, pad_id: int, device: torch.device):
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        self.cache = StaticCache(config=model.config, max_cache_len=prompt + tokens)
        # sliding-window layers (Gemma, Mistral) keep every position too: their window is then the
        # attention mask's alone, from the model's config. transformers' rolling layer branches on a
        # Python counter that a captured graph, a moved row or a rewind cannot follow
        self.cache.layers = [
            StaticLayer(max_cache_len=prompt + tokens) if getattr(layer, "is_sliding", False) else layer
            for layer in self.cache.layers
        ]
        self.tokens = torch.full((batch, tokens), pad_id, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(batch, tokens, device=device)
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)
        self.token = torch.zeros(batch, dtype=torch.long, device=device)
        self.at = torch.zeros((), dtype=torch.long, device=device)  # index of the last token recorded
        self.full = torch.ones(batch, prompt + tokens, dtype=torch.long, device=device)  # future slots: causal
        self.next_pos = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph | None] = {}  # None: warmed up, not yet captured
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.smaller: dict[int, DecodeState] = {}  # the loops of fewer rows that compaction moves to
        self.warmed_up = set()  # compiled (True), eager (False): its and its smaller loops' steps captured (_warm_up)

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def lengths(self) -> tuple[int, int]:
        """Prompt and response columns."""
        return self.full.shape[1] - self.tokens.shape[1], self.tokens.shape[1]

    def reset(self, mask: torch.Tensor, pad_id: int) -> None:
        self.cache.reset()
        self.tokens.fill_(pad_id)
        self.logprobs.zero_()
        self.done.zero_()
        self.at.zero_()
        self.full[:, : mask.shape[1]].copy_(mask)
        self.next_pos.copy_(mask.long().sum(-1, keepdim=True))  # where the first response token goes

    def after_prefill(self, prompt: int) -> None:
        """Back to where decoding starts, after the prompts' ``prompt`` columns: the next token is
        recorded first and the cache is written from column ``prompt`` on (what it holds is kept)."""
        self.at.zero_()
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", False):
                layer.cumulative_length.fill_(prompt)

    def take(self, other: DecodeState, rows: torch.Tensor) -> None:
        """Continue ``other``'s decoding for its ``rows`` (one per row of this loop): their keys and
        values, tokens and logprobs so far, ended flags, next token, masks and positions."""
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            keys, values = theirs.keys[rows], theirs.values[rows]
            if not mine.is_initialized:
                mine.lazy_initialization(keys, values)
            mine.keys.copy_(keys)
            mine.values.copy_(values)
            mine.cumulative_length.copy_(theirs.cumulative_length)
        for name in ("tokens", "logprobs", "done", "token", "full", "next_pos"):
            getattr(self, name).copy_(getattr(other, name)[rows])
        self.at.copy_(other.at)

    def mark_dynamic(self, on: bool = True) -> None:
        """Rows and cache length as dynamic dimensions for torch.compile (once the cache is filled), so
        that one compiled step serves the loops of every row count: a loop of fewer rows (compact_rows)
        or a call of another size then costs a CUDA graph capture, not a compilation. Not ``on``: the
        marks taken off again (a precompiled step's saved guards expect none)."""
        for t in (self.tokens, self.logprobs, self.done, self.token, self.full, self.next_pos):
            dims = (0, 1) if t is self.full else (0,)
            _mark(t, dims, on)
        for layer in self.cache.layers:
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, torch.Tensor):
                    _mark(t, (0, 2), on)

    def can_move(self) -> bool:
        """Whether :meth:`take` knows this loop's cache: transformers' static layers, filled."""
        return all(
            getattr(layer, "is_initialized", False)
            and all(hasattr(layer, a) for a in ("keys", "values", "cumulative_length", "lazy_initialization"))
            for layer in getattr(self.cache, "layers", [None])
        )


def sampling_warpers(sampling):
    """generate's own sampling processors: temperature, then top-k, then top-p."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    warpers = LogitsProcessorList()
    if sampling.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k > 0:
        warpers.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        warpers.append(TopPLogitsWarper(sampling.top_p))
    return warpers


def _mark(t: torch.Tensor, dims: tuple, on: bool) -> None:
    for dim in dims if on else ():
        torch._dynamo.maybe_mark_dynamic(t, dim)
    for name in [] if on else [n for n in vars(t) if n.startswith(("_dynamo_", "_has_dynamo", "_specializ"))]:
        delattr(t, name)


def decode_step(model, loop, sampling, warpers, is_end, pad_id, sample=None):
    """One decoding step on the static cache, on the device alone: the forward of the last token, the
    next one sampled (``sample``, else :func:`sample_token`) and recorded (:func:`record`)."""
    inputs = model.prepare_inputs_for_generation(
        loop.token[:, None],
        past_key_values=loop.cache,
        attention_mask=loop.full,
        position_ids=loop.next_pos + loop.at,
        use_cache=True,
    )
    token, logprob = (sample or sample_token)(model(**inputs).logits[:, -1], sampling, warpers)
    loop.at.add_(1)
    record(loop, token, logprob, sampling, is_end, pad_id)


def record(loop, token, logprob, sampling, is_end, pad_id) -> None:
    """Write the token and logprob of every row at ``loop.at`` (padding and 0 where the row has
    ended), then mark the rows whose token ends them (``is_end``: a table over the vocabulary)."""
    token = torch.where(loop.done, pad_id, token)
    loop.tokens.index_copy_(1, loop.at.view(1), token[:, None])
    loop.logprobs.index_copy_(1, loop.at.view(1), logprob.masked_fill(loop.done, 0.0)[:, None])
    loop.token.copy_(token)
    if not sampling.ignore_eos:
        loop.done.logical_or_(is_end[token])


def sample_token(logits, sampling, warpers):
    """A token as ``generate`` samples it (warped scores, softmax, ``torch.multinomial``), and its
    logprob under the temperature-scaled distribution the trainer scores."""
    scores = logits.float()
    logp = torch.log_softmax(scores / sampling.temperature, dim=-1)
    token = torch.multinomial(torch.softmax(warpers(None, scores), dim=-1), num_samples=1).squeeze(1)
    return token, logp.gather(-1, token[:, None]).squeeze(1)


def stopped_rows(tokenizer, tokens: torch.Tensor, done: torch.Tensor, stops: list[str]) -> torch.Tensor:
    """(B,) rows not yet done whose text so far (``tokens``, (B, t)) holds a stop string. Rows go on
    sampling until this check sees them (the same random draws as ``generate``, which samples for
    finished rows too); what follows the stop string is cut off after decoding."""
    rows = (~done).nonzero().flatten().tolist()
    texts = tokenizer.batch_decode(tokens[rows].tolist()) if rows else []
    hit = [i for i, text in zip(rows, texts) if any(s in text for s in stops)]
    stopped = torch.zeros_like(done)
    stopped[hit] = True
    return stopped
