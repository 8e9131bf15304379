"""Rollout engine ``hf``: transformers ``generate`` on a copy of the policy in this process."""

from __future__ import annotations

import torch
from pydantic import Field

from hybridrl.components import Options, RolloutEngine, RolloutOutput, SamplingParams
from hybridrl.hookspecs import hookimpl
from hybridrl.models import load_causal_lm


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


class HFEngine(RolloutEngine):
    class Options(Options):
        batch_size: int = Field(0, ge=0, description="Prompts per generate call; 0: all at once.")

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.model = load_causal_lm(ctx.model_path, ctx.dtype, ctx.device).eval()
        self.model.requires_grad_(False)
        self.tokenizer = ctx.tokenizer
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos if eos is not None else self.tokenizer.eos_token_id])
        self.pad_id = self.tokenizer.pad_token_id

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutOutput:
        size = self.options.batch_size or len(prompts)
        out = RolloutOutput([], [], [])
        for start in range(0, len(prompts), size):
            part = self._generate(prompts[start : start + size], sampling)
            out.token_ids += part.token_ids
            out.logprobs += part.logprobs
            out.finish_reasons += part.finish_reasons
        return out

    def _generate(self, prompts, sampling):
        from transformers import GenerationConfig, LogitsProcessorList

        P = max(len(p) for p in prompts)
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
            min_new_tokens=sampling.max_tokens if sampling.ignore_eos else None,
            num_return_sequences=sampling.n,
            eos_token_id=sorted(self.eos_ids),
            pad_token_id=self.pad_id,
            stop_strings=sampling.stop or None,
        )
        recorder = _LogprobRecorder(sampling.temperature)
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        seqs = self.model.generate(
            input_ids=ids.to(self.ctx.device),
            attention_mask=mask.to(self.ctx.device),
            generation_config=gen,
            logits_processor=LogitsProcessorList([recorder]),
            tokenizer=self.tokenizer if sampling.stop else None,
        )
        new = seqs[:, P:].cpu()
        recorder.collect(new[:, -1])
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
