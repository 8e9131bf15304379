"""The ``hf`` engine's plain path, on the CPU by default and wherever the static KV cache is off:
transformers ``generate`` on the dynamic cache, each prompt's forward pass made once for its
samples, and the logprob of every sampled token recorded as it is drawn."""

from __future__ import annotations

import torch


def generate_plain(model, tokenizer, ids, mask, sampling, eos_ids, last_logits_only: dict):
    """transformers ``generate`` of ``sampling.n`` samples of each row of ``ids``: the new tokens
    and their logprobs (at the sampling temperature), both (rows x n, new tokens)."""
    from transformers import GenerationConfig, LogitsProcessorList

    gen = GenerationConfig(
        do_sample=True,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        max_new_tokens=sampling.max_tokens,
        num_return_sequences=sampling.n,
        # ignore_eos: no end-of-sequence at all (min_new_tokens would instead mask EOS out of the
        # distribution, and the recorded logprobs would no longer be the model's)
        eos_token_id=None if sampling.ignore_eos else sorted(eos_ids),
        pad_token_id=tokenizer.pad_token_id,
        stop_strings=sampling.stop or None,
        disable_compile=True,  # compiled decoding is the static cache's loop
    )
    recorder = LogprobRecorder(sampling.temperature)
    ids, mask, cache = shared_prefill(model, ids, mask, sampling.n, last_logits_only)
    if cache is not None:
        gen.num_return_sequences = 1  # the rows are already repeated
    seqs = model.generate(
        input_ids=ids,
        attention_mask=mask,
        past_key_values=cache,
        generation_config=gen,
        logits_processor=LogitsProcessorList([recorder]),
        tokenizer=tokenizer if sampling.stop else None,
    )
    recorder.collect(seqs[:, -1])  # on the engine's device, like the recorded logprobs
    new = seqs[:, ids.shape[1] :]
    return new, torch.stack(recorder.steps, dim=1) if recorder.steps else torch.zeros(len(new), 0)


def shared_prefill(model, ids, mask, n, last_logits_only: dict):
    """Each prompt's keys and values computed once and repeated for its ``n`` samples, which
    ``generate`` then continues from its last token: the prompts' forward pass on 1/n of the
    rows. Returns the repeated ids and mask, and the cache (None where nothing is shared)."""
    from transformers import DynamicCache

    if n == 1 or ids.shape[1] < 2:
        return ids, mask, None
    cache = DynamicCache(config=model.config)
    head = mask[:, :-1]
    model(
        input_ids=ids[:, :-1],
        attention_mask=head,
        position_ids=(head.cumsum(-1) - 1).clamp(min=0),
        past_key_values=cache,
        use_cache=True,
        **last_logits_only,
    )
    cache.batch_repeat_interleave(n)
    return ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0), cache


class LogprobRecorder:
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
