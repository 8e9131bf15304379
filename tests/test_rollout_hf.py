"""The built-in hf rollout engine: grouping, logprobs that match the trainer's, weight sync."""

import pytest
import torch

from hybridrl import plugins
from hybridrl.batch import Batch
from hybridrl.components import RunContext, SamplingParams
from hybridrl.models import load_causal_lm, load_tokenizer, response_logprobs


@pytest.fixture
def engine(tiny_model, tmp_path):
    tok = load_tokenizer(tiny_model)
    ctx = RunContext(tiny_model, tok, torch.device("cpu"), torch.float32, 0, tmp_path)
    cls = plugins.lookup("rollout engine", "hf")
    return cls(cls.Options(), ctx)


def prompts(tok, texts):
    return [tok(t)["input_ids"] for t in texts]


def test_n_samples_grouped_by_prompt_and_reproducible(engine):
    p = prompts(engine.tokenizer, ["abc", "hello world"])
    sp = SamplingParams(n=3, max_tokens=8, seed=1)
    out = engine.generate(p, sp)
    assert len(out.token_ids) == 6 and len(out.finish_reasons) == 6
    assert all(len(t) == len(lp) <= 8 for t, lp in zip(out.token_ids, out.logprobs))
    assert engine.generate(p, sp).token_ids == out.token_ids  # same seed, same samples
    assert engine.generate(p, SamplingParams(n=3, max_tokens=8, seed=2)).token_ids != out.token_ids


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_logprobs_equal_trainer_logprobs(engine, tiny_model, temperature):
    tok = engine.tokenizer
    p = prompts(tok, ["abc", "a much longer prompt"])  # different lengths: left padding matters
    out = engine.generate(p, SamplingParams(n=2, max_tokens=10, temperature=temperature, seed=0))
    batch = Batch.from_rollout(p, out, 2, tok.pad_token_id)
    policy = load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        lp, _ = response_logprobs(
            policy, batch.input_ids, batch.attention_mask, batch["responses"].shape[1], temperature
        )
    mask = batch["response_mask"].bool()
    assert (lp[mask] - batch["rollout_logprobs"][mask]).abs().max().item() < 1e-4


def test_responses_end_at_the_first_eos_or_at_max_tokens(engine):
    out = engine.generate(prompts(engine.tokenizer, ["x"]), SamplingParams(n=64, max_tokens=40, seed=0))
    eos = engine.tokenizer.eos_token_id
    reasons = set(out.finish_reasons)
    assert reasons == {"stop", "length"}  # with ~1% EOS per token, both occur in 64 samples
    for ids, reason in zip(out.token_ids, out.finish_reasons):
        if reason == "stop":
            assert ids[-1] == eos and eos not in ids[:-1]
        else:
            assert len(ids) == 40 and eos not in ids


def test_update_weights_changes_generation(engine, tiny_model):
    p = prompts(engine.tokenizer, ["abc"])
    sp = SamplingParams(n=1, max_tokens=6, temperature=1e-3, seed=0)  # near greedy
    before = engine.generate(p, sp).token_ids
    other = load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))
    torch.manual_seed(123)
    with torch.no_grad():
        for t in other.parameters():
            t.add_(torch.randn_like(t))
    engine.update_weights(other.state_dict().items())
    after = engine.generate(p, sp).token_ids
    assert after != before
    for name, t in other.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], t)


def test_update_weights_rejects_unknown_names(engine):
    with pytest.raises(KeyError, match="'nope'"):
        engine.update_weights([("nope", torch.zeros(1))])


def test_ignore_eos_generates_exactly_max_tokens(engine):
    out = engine.generate(
        prompts(engine.tokenizer, ["x"]), SamplingParams(n=16, max_tokens=40, seed=0, ignore_eos=True)
    )
    assert [len(t) for t in out.token_ids] == [40] * 16 and set(out.finish_reasons) == {"length"}
