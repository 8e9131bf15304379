"""Rollout engine ``hf``: transformers ``generate`` on a copy of the policy in this process.

Fast path (the default on CUDA): the engine's copy in bfloat16, a static KV cache
(``cache_implementation="static"``: keys and values preallocated for prompt + ``max_tokens``)
and compiled decoding. With a static cache, ``generate`` compiles the one-token decoding
forward itself (``torch.compile``, mode ``reduce-overhead``: CUDA graphs on CUDA) and runs the
prefill eagerly; we pass ``compile_config`` to turn this on (also on the CPU) and
``disable_compile`` to turn it off. Only the model's forward is compiled: sampling and our
logprob recorder (a logits processor) stay Python, on a float32 copy of the logits. To
keep the compiled graphs reusable from step to step, prompts are left-padded to a multiple of
``pad_prompts_to_multiple`` tokens (generate keeps the largest cache length it has seen, so
the cache takes few distinct lengths) and, when compiling, a short last chunk of prompts is
filled up to ``batch_size`` with copies whose samples are dropped.

Why not transformers' continuous batching (``generate_batch``): its ``return_logprobs`` gives
the log of the sampled token's probability *after* top-k/top-p and the other processors,
not the temperature-scaled distribution the trainer scores (``response_logprobs``); it drops
the processors it does not support (``min_new_tokens``, which ``ignore_eos`` needs, and stop
strings), switches the attention to its paged kernels, and its options were still changing
between 5.x releases. Static cache + compile keeps ``generate``, whose logprobs the tests hold
against the trainer's.
"""

from __future__ import annotations

import contextlib
from typing import Literal

import torch
from pydantic import Field, model_validator

from hybridrl.components import Options, RolloutEngine, RolloutOutput, SamplingParams
from hybridrl.hookspecs import hookimpl
from hybridrl.models import load_causal_lm

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STATIC_PAD_MULTIPLE = 64  # prompt-length bucket with the static cache


class _LogprobRecorder:
    """Logits processor that records the logprob of each sampled token.

    It sees the raw logits of step t, and at step t + 1 the token sampled from them; so only
    one (B, V) vector is kept at a time, never the logits of the whole generation.
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.prev: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.collect(input_ids[:, -1])
        self.prev = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def collect(self, tokens: torch.Tensor) -> None:
        if self.prev is not None:
            self.steps.append(self.prev.gather(-1, tokens[:, None]).squeeze(-1))
            self.prev = None


def engine_dtype(choice: str, policy_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of the engine's copy: ``choice``, or for 'auto' bfloat16 on a CUDA GPU that
    supports it when the policy is float32, else the policy's."""
    if choice != "auto":
        return DTYPES[choice]
    if policy_dtype == torch.float32 and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return policy_dtype


@contextlib.contextmanager
def _no_default_eos(model, active: bool):
    """Without EOS in its generation config, ``generate`` falls back to the model's own; clear it."""
    saved = model.generation_config.eos_token_id
    if active:
        model.generation_config.eos_token_id = None
    try:
        yield
    finally:
        model.generation_config.eos_token_id = saved


class HFEngine(RolloutEngine):
    """transformers ``generate`` on a copy of the policy, with the logprob of each sampled token.
    Fast path, the default on CUDA: a bfloat16 copy, a static KV cache and compiled decoding
    (CUDA graphs), with prompts padded to a multiple of 64 tokens so that the compiled graphs
    serve every step; the first steps are slower while it compiles (set compile: off for short
    runs). On the CPU the defaults keep the plain path: dynamic cache, no compile, the policy's
    dtype. On a GPU, cache: dynamic (compile then stays off) and dtype set to model.dtype give
    the plain path."""

    class Options(Options):
        batch_size: int = Field(0, ge=0, description="Prompts per generate call; 0: all at once.")
        cache: Literal["auto", "dynamic", "static"] = Field(
            "auto",
            description="KV cache of generate: 'static' preallocates prompt + max_tokens per sequence "
            "(fixed shapes, which compiled decoding needs); 'dynamic' grows it. 'auto': static on CUDA, "
            "dynamic elsewhere (static too when compile is 'on').",
        )
        compile: Literal["auto", "on", "off"] = Field(
            "auto",
            description="Compile the decoding forward with torch.compile (with CUDA graphs on CUDA); needs "
            "the static cache. 'auto': on with the static cache on CUDA, off elsewhere. The first steps "
            "are slower while it compiles.",
        )
        dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
            "auto",
            description="Dtype of the engine's copy of the policy. 'auto': bfloat16 on a CUDA GPU that "
            "supports it when the policy is float32, else the policy's. A lower precision than the "
            "policy's shows up in rollout/logprob_diff_*.",
        )
        pad_prompts_to_multiple: int = Field(
            0,
            ge=0,
            description=f"Left-pad prompts to a multiple of this many tokens, so that shapes repeat "
            f"across steps; 0: {STATIC_PAD_MULTIPLE} with the static cache, else 1 (no extra padding).",
        )

        @model_validator(mode="after")
        def _compile_needs_static_cache(self):
            if self.compile == "on" and self.cache == "dynamic":
                raise ValueError("compile 'on' needs the static cache: set cache to 'static' or 'auto'.")
            return self

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        o, cuda = options, ctx.device.type == "cuda"
        self.static = o.cache == "static" or (o.cache == "auto" and (cuda or o.compile == "on"))
        self.compile = self.static and (o.compile == "on" or (o.compile == "auto" and cuda))
        self.pad_multiple = o.pad_prompts_to_multiple or (STATIC_PAD_MULTIPLE if self.static else 1)
        dtype = engine_dtype(o.dtype, ctx.dtype, ctx.device)
        self.model = load_causal_lm(ctx.model_path, dtype, ctx.device).eval()
        self.model.requires_grad_(False)
        self.tokenizer = ctx.tokenizer
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos if eos is not None else self.tokenizer.eos_token_id])
        self.pad_id = self.tokenizer.pad_token_id

    def _compile_config(self):
        """How generate compiles the decoding forward: its own default on CUDA (inductor,
        CUDA graphs); on other devices plain inductor, which generate must be told to allow."""
        from transformers import CompileConfig

        if self.ctx.device.type == "cuda":
            return CompileConfig()
        config = CompileConfig(mode="default")
        config._compile_all_devices = True
        return config

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutOutput:
        size = self.options.batch_size or len(prompts)
        out = RolloutOutput([], [], [])
        for start in range(0, len(prompts), size):
            chunk = prompts[start : start + size]
            filler = [chunk[-1]] * (size - len(chunk)) if self.compile else []  # same shapes every call
            part = self._generate(chunk + filler, sampling)
            keep = len(chunk) * sampling.n
            out.token_ids += part.token_ids[:keep]
            out.logprobs += part.logprobs[:keep]
            out.finish_reasons += part.finish_reasons[:keep]
        return out

    def _generate(self, prompts, sampling):
        from transformers import GenerationConfig, LogitsProcessorList

        m = self.pad_multiple
        P = -(-max(len(p) for p in prompts) // m) * m
        ids = torch.full((len(prompts), P), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, P - len(p) :] = torch.tensor(p)
            mask[i, P - len(p) :] = 1
        gen = GenerationConfig(
            do_sample=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_new_tokens=sampling.max_tokens,
            num_return_sequences=sampling.n,
            # ignore_eos: no end-of-sequence at all (min_new_tokens would instead mask EOS out of the
            # distribution, and the recorded logprobs would no longer be the model's)
            eos_token_id=None if sampling.ignore_eos else sorted(self.eos_ids),
            pad_token_id=self.pad_id,
            stop_strings=sampling.stop or None,
            cache_implementation="static" if self.static else None,
            compile_config=self._compile_config() if self.compile else None,
            disable_compile=not self.compile,
        )
        recorder = _LogprobRecorder(sampling.temperature)
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        with _no_default_eos(self.model, sampling.ignore_eos):
            seqs = self.model.generate(
                input_ids=ids.to(self.ctx.device),
                attention_mask=mask.to(self.ctx.device),
                generation_config=gen,
                logits_processor=LogitsProcessorList([recorder]),
                tokenizer=self.tokenizer if sampling.stop else None,
            )
        recorder.collect(seqs[:, -1])  # on the engine's device, like the recorded logprobs
        new = seqs[:, P:].cpu()
        logprobs = torch.stack(recorder.steps, dim=1).cpu() if recorder.steps else torch.zeros(len(new), 0)
        out = RolloutOutput([], [], [])
        for row, lp in zip(new.tolist(), logprobs.tolist()):
            end = None if sampling.ignore_eos else next((i + 1 for i, t in enumerate(row) if t in self.eos_ids), None)
            if end is None and sampling.stop:
                text_end = self._stop_end(row, sampling.stop)
                end = text_end
            out.token_ids.append(row[: end or len(row)])
            out.logprobs.append(lp[: end or len(row)])
            out.finish_reasons.append("stop" if end is not None else "length")
        return out

    def _stop_end(self, row, stops):
        """Length of ``row`` up to and including the token that completes a stop string."""
        for i in range(1, len(row) + 1):
            text = self.tokenizer.decode(row[:i])
            if any(s in text for s in stops):
                return i
        return None

    @torch.no_grad()
    def update_weights(self, named_tensors):
        params = self.model.state_dict(keep_vars=True)  # tied weights under both names
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"hf rollout engine: the policy sent weight '{name}', which its model does not have.")
            params[name].copy_(tensor)

    def close(self):
        del self.model


@hookimpl
def register_rollout_engines(register):
    register("hf", HFEngine)
