"""The options of rollout engine ``hf`` (:mod:`hybridrl.builtin.rollout_hf` says what they drive)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from hybridrl.components import Options

STATIC_PAD_MULTIPLE = 64  # prompt-length bucket with the static cache
KEPT_SHAPES = 2  # decoding loops kept, by shape: the rollouts' and an evaluation's
FINISHED_CHECK_EVERY = 16  # tokens between checks that every sequence has ended (graph_tokens: 0)


class HFEngineOptions(Options):
    """The options of rollout engine ``hf`` (:class:`hybridrl.builtin.rollout_hf.HFEngine`)."""

    batch_size: int = Field(0, ge=0, description="Prompts per generate call; 0: all at once.")
    cache: Literal["auto", "dynamic", "static"] = Field(
        "auto",
        description="KV cache of generate: 'static' preallocates prompt + max_tokens per sequence "
        "(fixed shapes, which compiled decoding needs); 'dynamic' grows it. 'auto': static on CUDA, "
        "dynamic elsewhere (static too when compile is 'on').",
    )
    compile: Literal["auto", "on", "off", "background"] = Field(
        "auto",
        description="Compile each decoding step (mask, forward, sampling) with torch.compile, replayed as CUDA "
        "graphs on CUDA (graph_tokens); needs the static cache. 'auto': on with the static cache on CUDA when the run "
        "plans at least two million response tokens (trainer.steps x responses x max_tokens: what pays back about a "
        "minute of compiling), or whatever its length where an earlier run of the model with these options saved the "
        "step precompiled (it loads in about a second), off elsewhere. It compiles once (rows and prompt widths share "
        "the step), at step 1. 'background': a process of its own compiles it while calls decode eagerly (the same "
        "samples; hf/eager_calls).",
    )
    compact_rows: bool = Field(
        True,
        description="Static cache: at each check of ended sequences (every graph_tokens tokens), once at "
        "least half of a call's rows have ended, move the rows still running to a loop of half as many "
        "rows (down to a sixteenth of the call's, and on a GPU to 64), so that decoding steps stop "
        "computing finished ones. Each row count keeps its own cache and CUDA graphs (the compiled step is "
        "shared); on CUDA the run's first call makes and captures every loop it can reach. The logprobs are "
        "exact either way; the random draws fall to other rows, so the samples "
        "differ from generate's for the same seed. "
        "false: every row runs until the last one ends.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Dtype of the engine's copy of the policy. 'auto': bfloat16 on a CUDA GPU that "
        "supports it when the policy is float32, else the policy's. A lower precision than the "
        "policy's shows up in rollout/logprob_diff_*.",
    )
    fuse_projections: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Run each layer's q/k/v projections, and its gate and up projections, as one "
        "matrix multiplication each in the engine's copy (fewer, wider kernels per decoding step). "
        "'auto': on with the static cache.",
    )
    compile_after: int = Field(
        3,
        ge=1,
        description="Compiled decoding: the run's own sampling setting (the rollout section's) compiles at its "
        "first call; any other decodes eagerly for its first calls and is compiled at this one, so that "
        "settings used once or twice (an evaluation's greedy decoding before and after training) cost no "
        "compilation. 1: every setting at once.",
    )
    graph_tokens: int = Field(
        FINISHED_CHECK_EVERY,
        ge=0,
        description="Decoding on the static cache on CUDA, compiled or not: this many decoding steps are "
        "captured as one CUDA graph and launched as one, and the host checks whether every sequence has "
        "ended between two of them. A step that cannot be captured (a forward that waits for the device, as "
        "float32 MoE experts do), eager or compiled, decodes without graphs, said once. 0: no CUDA graphs "
        f"(each step's kernels launched one by one, the check every {FINISHED_CHECK_EVERY} tokens).",
    )
    pad_prompts_to_multiple: int = Field(
        0,
        ge=0,
        description=f"Left-pad prompts to a multiple of this many tokens, so that shapes repeat "
        f"across steps; 0: {STATIC_PAD_MULTIPLE} with the static cache, else 1 (no extra padding).",
    )

    @model_validator(mode="after")
    def _compile_needs_static_cache(self):
        if self.compile in ("on", "background") and self.cache == "dynamic":
            raise ValueError(f"compile '{self.compile}' needs the static cache: set cache to 'static' or 'auto'.")
        return self
