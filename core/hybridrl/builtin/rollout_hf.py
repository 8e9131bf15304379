"""Rollout engine ``hf``: a transformers copy of the policy in this process.

Fast path (the default on CUDA): the engine's copy in bfloat16, a static KV cache (keys and
values preallocated for prompt + ``max_tokens``) and our own decoding loop (``_decode``). The
loop samples exactly as ``generate`` does (its temperature/top-k/top-p processors, softmax,
``torch.multinomial``: the same tokens for the same seed) and records each token's logprob
under the temperature-scaled distribution the trainer scores. One decoding step (the attention
mask, the forward, the sampling, the bookkeeping of tokens and ended rows) keeps its state on
the device (``DecodeState``) and, compiled, is one graph; on CUDA ``graph_tokens`` steps (16),
compiled or eager, are captured as one CUDA graph and replayed as one launch, and the host waits for the device
only between two such runs, to see whether every sequence has ended (at an end token, or with
a stop string in its decoded text); the prefill runs eagerly, and a call for one token (the
sync check's probe) is the prefill alone. At those checks, once at least half of the rows have
ended, the rows still running move to a loop of half as many rows (``compact_rows``), so that
long-tail lengths stop paying for the finished ones. What the fast path changes in the model
(attention that reads a grouped-query cache in place, q/k/v and gate/up projections as one
matrix multiplication each) lives in :mod:`hybridrl.builtin.hf_fast_path`. To keep the
compiled graphs reusable from step to step, prompts are left-padded to a multiple of
``pad_prompts_to_multiple`` tokens and, when compiling, a short last chunk of prompts is filled
up to ``batch_size`` with copies whose samples are dropped.

The dynamic cache (the CPU default) goes through transformers ``generate``, with a logits
processor that records the logprobs, after a prefill of each prompt once whose cache is
repeated for its ``n`` samples (``hf_generate.shared_prefill``: about 2 s of a 10.5 s rollout saved at the
demo's sizes). Both paths end a response at its first end token or at the token that
completes a stop string, whichever comes first. Why not transformers' continuous batching:
docs/performance.md.
"""

from __future__ import annotations

import inspect
import time

import torch
from torch._dynamo.utils import counters

from hybridrl import lora
from hybridrl.builtin.hf_background import Background
from hybridrl.builtin.hf_fast_path import (
    DecodeState,
    GraphStats,
    capturing,
    compacted_rows,
    compile_pays,
    decode_step,
    engine_dtype,
    fuse_projections,
    keeps_prompt_width,
    record,
    row_floor,
    sample_token,
    sampling_warpers,
    steps_between_checks,
    stopped_rows,
    use_grouped_decode_attention,
)
from hybridrl.builtin.hf_generate import generate_plain
from hybridrl.builtin.hf_options import FINISHED_CHECK_EVERY, KEPT_SHAPES, STATIC_PAD_MULTIPLE, HFEngineOptions
from hybridrl.compile import Precompiled, allow_recompiles
from hybridrl.components import RolloutEngine, RolloutOutput, SamplingParams
from hybridrl.engines import stop_length
from hybridrl.hookspecs import hookimpl
from hybridrl.models import end_token_ids, load_causal_lm


class HFEngine(RolloutEngine):
    """A transformers copy of the policy, with the logprob of each sampled token.
    Fast path, the default on CUDA: a bfloat16 copy, a static KV cache and a decoding loop replayed
    as CUDA graphs (16 tokens each), compiled when the run is long enough to pay it back (compile:
    auto), with prompts padded to a multiple of 64 tokens so that the graphs serve every step. On
    the CPU the defaults keep the plain path: dynamic cache, no compile, the policy's dtype. On a
    GPU, cache: dynamic (compile then stays off) and dtype set to model.dtype give the plain path."""

    weight_format = "transformers"  # its model is a transformers copy of the policy

    Options = HFEngineOptions

    serves_quantized_base = True  # it loads the policy's quantized base (model.lora.quantize) as the policy does

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        o, cuda = options, ctx.device.type == "cuda"
        quantize = ctx.lora.quantize if ctx.lora else "none"
        # bitsandbytes' layers decode on the default path: the fast path's fused and captured steps take plain weights
        static = o.cache == "static" or (o.cache == "auto" and (cuda or o.compile in ("on", "background")))
        self.static = static and quantize == "none"
        self.compile = self.static and compile_pays(o.compile.replace("background", "on"), ctx, self._key_options(o))
        self.pad_multiple = o.pad_prompts_to_multiple or (STATIC_PAD_MULTIPLE if self.static else 1)
        dtype = engine_dtype(o.dtype, ctx.dtype, ctx.device)
        dtype = ctx.dtype if quantize != "none" else dtype  # the policy's compute dtype over the same quantized base
        self.model = load_causal_lm(ctx.model_path, dtype, ctx.device, ctx.trust_remote_code, quantize=quantize).eval()
        self.model.requires_grad_(False)
        self.tokenizer = ctx.tokenizer
        # what the fast path changed in the engine's copy, for tests and logs
        self.grouped_attention = self.static and use_grouped_decode_attention(self.model)
        fuse = quantize == "none" and (o.fuse_projections == "on" or (o.fuse_projections == "auto" and self.static))
        self.fused_groups = fuse_projections(self.model) if fuse else 0
        self.eos_ids = end_token_ids(ctx.model_path, self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id
        # generate fills every field a call leaves unset from the model's generation config, and
        # chat checkpoints ship sampling settings there (top_k, min_p, repetition_penalty...): the
        # engine keeps an empty one, so that it samples from the run's config alone
        from transformers import GenerationConfig

        self.model.generation_config = GenerationConfig()
        self._loops: dict[tuple, DecodeState] = {}  # by (rows, prompt, response) columns, least recent first
        self._row_steps = [0, 0]  # decoded row-steps of this step's calls, and what they were without compaction
        self._compiled_step, self._is_end, self.graph_tokens = None, None, o.graph_tokens
        self._uncapturable = set()  # compiled (True) and eager (False) decoding steps whose capture failed
        self._graphs = GraphStats()  # this step's new loops, warm-up runs and captures (hf/graph_*)
        # prompts padded to the widest bucket so far, from the data's longest on (keeps_prompt_width)
        self._keeps_width = keeps_prompt_width(self.compile, self.static, cuda, o.graph_tokens)
        self._width = -(-(ctx.prompt_tokens or 0) // self.pad_multiple) * self.pad_multiple if self._keeps_width else 0
        self._compile_s = 0.0  # seconds of decoding calls that compiled a step (or loading one), this run
        self._background = Background() if self.compile and o.compile == "background" else None
        self._uses: dict[tuple, int] = {}  # decoding calls of each sampling setting (compile_after)
        s = ctx.sampling  # the run's own setting compiles at its first call
        self._run_setting = (s.temperature, s.top_k, s.top_p, s.ignore_eos) if s is not None else None
        takes_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self._last_logits_only = {"logits_to_keep": 1} if takes_keep else {}

    def memory_options(self, half_prompts: int) -> str:
        return f"rollout.batch_size (prompts per generate call; try {half_prompts})"

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutOutput:
        size = self.options.batch_size or len(prompts)
        out = RolloutOutput([], [], [])
        for start in range(0, len(prompts), size):
            chunk = prompts[start : start + size]
            filler = [chunk[-1]] * (size - len(chunk)) if self._keeps_width else []  # same shapes every call
            part = self._generate(chunk + filler, sampling)
            keep = len(chunk) * sampling.n
            out.token_ids += part.token_ids[:keep]
            out.logprobs += part.logprobs[:keep]
            out.finish_reasons += part.finish_reasons[:keep]
        return out

    def _generate(self, prompts, sampling):
        m = self.pad_multiple
        P = max(-(-max(len(p) for p in prompts) // m) * m, self._width)
        self._width = P if self._keeps_width else 0
        ids = torch.full((len(prompts), P), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, P - len(p) :] = torch.tensor(p)
            mask[i, P - len(p) :] = 1
        seed = sampling.seeds[0] if sampling.seeds else sampling.seed  # one generator for the call
        if seed is not None:
            torch.manual_seed(seed)
        ids, mask = ids.to(self.ctx.device), mask.to(self.ctx.device)
        decode = self._decode if self.static else self._generate_plain
        new, logprobs = (t.cpu() for t in decode(ids, mask, sampling))
        out = RolloutOutput([], [], [])
        for row, lp in zip(new.tolist(), logprobs.tolist()):
            end = None if sampling.ignore_eos else next((i + 1 for i, t in enumerate(row) if t in self.eos_ids), None)
            if sampling.stop:  # a stop string before the end token ends it there (after it: padding)
                end = stop_length(row[:end], self.tokenizer.decode, sampling.stop) or end
            out.token_ids.append(row[: end or len(row)])
            out.logprobs.append(lp[: end or len(row)])
            out.finish_reasons.append("stop" if end is not None else "length")
        return out

    def _generate_plain(self, ids, mask, sampling):
        return generate_plain(self.model, self.tokenizer, ids, mask, sampling, self.eos_ids, self._last_logits_only)

    def _sample(self, logits, sampling, warpers):
        """The next token and its logprob (:func:`sample_token`, as ``generate`` samples)."""
        return sample_token(logits, sampling, warpers)

    def _step(self, loop, sampling, warpers):
        """One decoding step (:func:`decode_step`), eager."""
        decode_step(self.model, loop, sampling, warpers, self._is_end, self.pad_id, self._sample)

    def _decode(self, ids, mask, sampling):
        """Our own sampling loop on the static KV cache. It samples as ``generate`` does (the same
        tokens for the same seed) without its per-token overhead: each step is one compiled graph
        (mask, forward, sampling, bookkeeping), on CUDA ``graph_tokens`` steps are captured as one
        CUDA graph, and nothing waits for the device except a check that every sequence has ended,
        between two such runs of steps."""
        model, n, T = self.model, sampling.n, sampling.max_tokens
        ids, mask = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
        (B, P), device = ids.shape, ids.device
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        warpers = sampling_warpers(sampling)
        if T == 1:  # one token (the sync check's probe): the prefill alone, the rollout's loop kept
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, **self._last_logits_only).logits
            token, logprob = self._sample(logits[:, -1], sampling, warpers)
            return token[:, None], logprob[:, None]
        loop = self._loop(B, P, T, device)
        loop.reset(mask, self.pad_id)
        self._first_call(device)
        inputs = model.prepare_inputs_for_generation(
            ids, past_key_values=loop.cache, attention_mask=loop.full, position_ids=pos, use_cache=True,
            is_first_iteration=True,
        )  # fmt: skip
        # the cache stays the loop's whatever a model's preparation does with it, and one position's logits
        inputs |= {"past_key_values": loop.cache, **self._last_logits_only}
        token, logprob = self._sample(model(**inputs).logits[:, -1], sampling, warpers)
        record(loop, token, logprob, sampling, self._is_end, self.pad_id)  # prefill eager, like generate
        setting = (sampling.temperature, sampling.top_k, sampling.top_p, sampling.ignore_eos)
        self._uses[setting] = self._uses.get(setting, 0) + 1
        own = setting == self._run_setting  # the run's own setting: captured at once, every loop warmed up
        compiled = self.compile and (own or self._uses[setting] >= self.options.compile_after)
        compiled = compiled and (not self._background or self._background.compiled_now(self, loop, sampling, warpers))
        every = self.graph_tokens or FINISHED_CHECK_EVERY
        ends, recorded = not sampling.ignore_eos or bool(sampling.stop), 1
        first, moves = loop, []  # (the loop moved from, the rows of it moved) of each compaction
        while recorded < T:
            steps = min(every - recorded % every, T - recorded)
            self._run_steps(loop, steps, sampling, warpers, compiled, at_once=own)
            recorded += steps
            self._row_steps[0] += loop.rows * steps
            if ends and recorded % every == 0:
                if sampling.stop:
                    hit = stopped_rows(self.tokenizer, loop.tokens[:, :recorded], loop.done, sampling.stop)
                    loop.done.logical_or_(hit)
                running = int((~loop.done).sum())
                if running == 0:
                    break
                smaller, rows = self._compact(first, loop, running)
                if smaller is not None:
                    moves.append((loop, rows))
                    loop = smaller
        self._row_steps[1] += B * (recorded - 1)
        for parent, rows in reversed(moves):  # each loop's rows back into the loop they came from
            parent.tokens.index_copy_(0, rows, loop.tokens)
            parent.logprobs.index_copy_(0, rows, loop.logprobs)
            loop = parent
        tokens, logprobs = loop.tokens[:, :recorded], loop.logprobs[:, :recorded]
        if own and compiled not in first.warmed_up and first.pool is not None and self._captures(compiled):
            tokens, logprobs = tokens.clone(), logprobs.clone()  # warming up reuses the loop's buffers
            self._warm_up(first, T, sampling, warpers, compiled, ends)
        return tokens, logprobs

    def _first_call(self, device) -> None:
        """What decoding makes at its first call: the end-token table and, compiled, the compiled step."""
        if self._is_end is None:
            # a table lookup per token: torch.isin over more than a few end ids sorts on the device and
            # waits for it, which stalls the queue of compiled steps at every token
            vocab = max(self.model.get_output_embeddings().weight.shape[0], max(self.eos_ids, default=0) + 1)
            self._is_end = torch.zeros(vocab, dtype=torch.bool, device=device)
            self._is_end[sorted(self.eos_ids)] = True
        if self.compile and self._compiled_step is None:
            allow_recompiles()  # a graph for each prompt width and sampling setting
            own = type(self)._sample is HFEngine._sample  # a subclass's own sampling: compiled in each run
            mark = lambda on, model, loop, *_: loop.mark_dynamic(on)  # noqa: E731 - rows dynamic; graphs: _run_steps
            key = ("rollout.compile", self._key_options(self.options), lora.has_adapter(self.model))  # what the engine
            step = self._precompiled = Precompiled(decode_step, self.ctx, mark, key, aot=own)  # changed in the model
            self._compile_s += step.load_s  # (fusions, adapters) in the key; loading it: this run's compiling
            extra = () if own else (self._sample,)
            self._compiled_step = lambda loop, s, w: step(self.model, loop, s, w, self._is_end, self.pad_id, *extra)

    def _warm_up(self, first, tokens, sampling, warpers, compiled: bool, ends: bool):
        """Every run of steps a call of the run's own setting can reach, warmed up and captured now, at
        the first call: those of the call's loop, and with ``compact_rows`` those of each loop of fewer
        rows that compaction can move to (made now). A later step whose responses end sooner or later
        than the first's then replays graphs instead of running a warm-up and a capture (which, at
        the step a new number of rows first appeared, was a stall). Each loop starts from the state
        after the prompts' forward pass (its buffers' contents are overwritten when it is next used)."""
        runs = steps_between_checks(tokens, self.graph_tokens)
        loops = [(first, set(runs))]
        if ends and self.options.compact_rows and first.can_move():
            rows = first.rows
            while (half := compacted_rows(rows, rows // 2, first.rows, row_floor(first.done.device))) < rows:
                rows = half
                smaller = self._smaller_loop(first, rows)
                smaller.take(first, torch.arange(rows, device=first.done.device))
                loops.append((smaller, set(runs[1:])))  # smaller loops begin after a check
        for loop, steps in loops:
            for n in sorted(steps):
                if loop.graphs.get(self._graph_key(n, sampling, compiled)) is None:  # not captured yet
                    loop.after_prefill(first.lengths[0])
                    self._run_steps(loop, n, sampling, warpers, compiled, at_once=True)
        first.warmed_up.add(compiled)

    def _compact(self, first, loop, running):
        """The loop of fewer rows to go on in when ``running`` rows of ``loop`` have not ended
        (:func:`compacted_rows` of ``first``'s, the call's), with the rows of ``loop`` it
        continues, those running first; or (None, None) to stay."""
        if not self.options.compact_rows:
            return None, None
        rows = compacted_rows(loop.rows, running, first.rows, row_floor(loop.done.device))
        if rows == loop.rows or not loop.can_move():
            return None, None
        smaller = self._smaller_loop(first, rows)
        order = torch.sort(loop.done.to(torch.uint8), stable=True).indices[:rows]  # running, then ended rows
        smaller.take(loop, order)
        return smaller, order

    def _smaller_loop(self, first, rows: int) -> DecodeState:
        """``first``'s loop of ``rows`` rows, made the first time it is asked for."""
        if rows not in first.smaller:
            first.smaller[rows] = DecodeState(self.model, rows, *first.lengths, self.pad_id, first.done.device)
            self._graphs.loops += 1
        return first.smaller[rows]

    @staticmethod
    def _key_options(options) -> str:
        """The engine's options that change its compiled step, for the keys of the step kept for later runs."""
        return options.model_dump_json(exclude={"compile", "compile_after", "graph_tokens", "batch_size"})

    @staticmethod
    def _graph_key(steps: int, sampling, compiled: bool) -> tuple:
        return compiled, steps, sampling.temperature, sampling.top_k, sampling.top_p, sampling.ignore_eos

    def _captures(self, compiled: bool) -> bool:
        """Whether decoding steps are captured as CUDA graphs (on a loop with a graph pool: CUDA)."""
        return bool(self.graph_tokens) and compiled not in self._uncapturable

    def _run_steps(self, loop, steps, sampling, warpers, compiled: bool, at_once: bool = False):
        """``steps`` decoding steps. On CUDA (with ``graph_tokens``), the first run of a number of
        steps and sampling settings runs them as they are (which compiles the step, if compiled, and
        warms up its kernels), then captures them as one CUDA graph, at once (``at_once``: the run's
        own setting) or at their second run (a setting used once, an evaluation's, captures
        nothing), and every run from then on replays it: the host launches one graph instead of
        each step's kernels, and keeps no per-step bookkeeping. Eager steps are captured too (their
        many small kernels cost more to launch than to run), unless a capture failed once
        (:meth:`_capture`)."""
        step, key = self._compiled_step if compiled else self._step, self._graph_key(steps, sampling, compiled)
        graphs = loop.graphs if self._captures(compiled) and loop.pool is not None else None
        if graphs is not None and graphs.get(key) is not None:
            graphs[key].replay()
            return
        ran = graphs is None or key not in graphs
        if ran:  # the first run: as it is
            graphs_before, start = counters["stats"]["unique_graphs"], time.perf_counter()
            for _ in range(steps):
                step(loop, sampling, warpers)
            if compiled and counters["stats"]["unique_graphs"] > graphs_before:  # this run of steps compiled one
                self._compile_s += time.perf_counter() - start
            if graphs is None:
                return
            graphs[key] = None  # warmed up: captured now or at the next run
            self._graphs.warmed(start)
            if not at_once:
                return
        start = time.perf_counter()
        graphs[key] = self._capture(loop, steps, step, sampling, warpers, compiled)
        self._graphs.captured(start)
        if graphs[key] is None:  # eager steps that cannot be captured: run as they are from now on
            del graphs[key]
            if not ran:
                for _ in range(steps):
                    step(loop, sampling, warpers)
        elif not ran:
            graphs[key].replay()  # a capture runs nothing

    def _capture(self, loop, steps, step, sampling, warpers, compiled: bool):
        """``steps`` decoding steps captured as one CUDA graph (nothing runs until it is replayed); None
        where a step cannot be captured, a forward that waits for the device (a host sync, which a
        capture does not permit: Mixtral's and Qwen3-MoE's float32 experts in transformers' grouped
        matmul fallback): decoding, eager or compiled alike, then goes on without graphs for the run."""
        graph = torch.cuda.CUDAGraph()
        try:
            with capturing(graph, loop.pool):
                for _ in range(steps):
                    step(loop, sampling, warpers)
        except RuntimeError as e:
            self._uncapturable.add(compiled)
            if self.ctx.is_main:
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                print(f"rollout engine 'hf': {'compiled' if compiled else 'eager'} decoding cannot be captured as CUDA "
                      f"graphs ({reason}); decoding without them", flush=True)  # fmt: skip
            return None
        return graph

    def _loop(self, batch, prompt, tokens, device) -> DecodeState:
        """The loop of this shape, kept with its smaller loops and graphs for the next call of the same
        shape. The loops of two shapes are kept, the rollouts' and an evaluation's (whose last call
        of fewer prompts would otherwise free the rollouts' loop, and the step after every evaluation
        would warm up and capture it again); a third shape first frees the one used least recently."""
        key = (batch, prompt, tokens)
        loop = self._loops.pop(key, None)
        if loop is None:
            while len(self._loops) >= KEPT_SHAPES:
                del self._loops[next(iter(self._loops))]
            loop = DecodeState(self.model, batch, prompt, tokens, self.pad_id, device)
        self._loops[key] = loop  # the most recent last
        return loop

    @property
    def _loop_key(self) -> tuple | None:
        """The shape of the last call's loop (tests, logs)."""
        return next(reversed(self._loops), None)

    @property
    def _loop_state(self) -> DecodeState | None:
        """The last call's loop."""
        return self._loops[self._loop_key] if self._loops else None

    def metrics(self) -> dict[str, float]:
        """``hf/decoded_row_fraction``: the rows x decoding steps the static loop computed in the
        step's calls, over what it would have without ``compact_rows`` (1: nothing saved)."""
        decoded, whole = self._row_steps
        self._row_steps = [0, 0]
        out = {"hf/compile_s": self._compile_s} if self.compile else {}  # the run's, so far
        out |= {"hf/eager_calls": self._background.eager_calls} if self._background else {}  # while it compiled
        out |= self._graphs.metrics() if self.static and self.graph_tokens and self.ctx.device.type == "cuda" else {}
        return out | ({"hf/decoded_row_fraction": decoded / whole} if whole else {})

    @torch.no_grad()
    def update_weights(self, named_tensors):
        params = self.model.state_dict(keep_vars=True)  # tied weights under both names
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"hf rollout engine: the policy sent weight '{name}', which its model does not have.")
            params[name].copy_(tensor)

    def takes_adapter(self, config):
        if self.fused_groups:
            return "its fast path fused the projections that share an input (rollout.options.fuse_projections: off)"
        return None

    @torch.no_grad()
    def update_adapter(self, adapter):
        """The policy's adapter over the engine's base, unmerged: its layers injected at the first sync
        (the decoding loops built before then are dropped: they ran the model without them)."""
        if not lora.has_adapter(self.model):
            self._loops.clear()
            self._compiled_step = None
        lora.load_adapter(self.model, adapter)

    def close(self):
        self._background and self._background.close()  # a compiling child goes on, for the next run
        self.__dict__.pop("model", None)  # a second close is a no-op


@hookimpl
def register_rollout_engines(register):
    register("hf", HFEngine)
