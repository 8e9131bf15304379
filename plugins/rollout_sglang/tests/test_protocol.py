"""Request building and output parsing, without an engine: pure functions on SGLang's formats.

The outputs below have the shapes SGLang 0.5.x returns: in-process (``sglang.Engine.generate``
with ``skip_tokenizer_init=True``) logprob entries are tuples and ``output_ids`` keeps the stop
token; over HTTP they are lists, with ``text``, and a trimmed stop token when ``no_stop_trim``
is false.
"""

import numpy as np
import pytest
import torch
from hybridrl_rollout_sglang import protocol
from hybridrl_rollout_sglang.protocol import SGLangOutputError

from hybridrl.components import SamplingParams
from hybridrl.engines import stop_length, weight_buckets

EOS = 151645


def engine_output():
    # sglang.Engine(skip_tokenizer_init=True).generate(input_ids=[...], return_logprob=True)
    return {
        "output_ids": [785, 6722, EOS],
        "meta_info": {
            "id": "4f6e0c2b",
            "finish_reason": {"type": "stop", "matched": EOS},
            "prompt_tokens": 12,
            "completion_tokens": 3,
            "cached_tokens": 0,
            "input_token_logprobs": [(None, 198, None)],
            "output_token_logprobs": [(-0.51, 785, None), (-2.25, 6722, None), (-0.0031, EOS, None)],
        },
    }


def server_output():
    # POST /generate over HTTP, tokenizer loaded, stop token trimmed from output_ids
    return {
        "text": "Paris",
        "output_ids": [785, 6722],
        "meta_info": {
            "id": "9a1d",
            "finish_reason": {"type": "stop", "matched": EOS},
            "prompt_tokens": 12,
            "completion_tokens": 3,
            "cached_tokens": 11,
            "output_token_logprobs": [[-0.51, 785, None], [-2.25, 6722, None], [-0.0031, EOS, None]],
        },
    }


def length_output():
    return {
        "output_ids": [11, 12, 13, 14],
        "meta_info": {
            "finish_reason": {"type": "length", "length": 4},
            "output_token_logprobs": [[-1.0, 11, None], [-1.5, 12, None], [-0.25, 13, None], [-3.0, 14, None]],
        },
    }


def test_sampling_params_are_explicit_so_model_defaults_cannot_change_the_distribution():
    s = SamplingParams(n=4, temperature=0.7, top_p=0.9, top_k=0, max_tokens=32, stop=["\n\n"], seed=5)
    p = protocol.sampling_params(s, {EOS, 151643})
    assert p == {
        "max_new_tokens": 32,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,  # hybridrl's 0 (off) is SGLang's -1
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "stop_token_ids": [151643, EOS],
        "ignore_eos": False,
        "no_stop_trim": True,
    }
    assert protocol.sampling_params(SamplingParams(top_k=20), [])["top_k"] == 20
    forced = protocol.sampling_params(SamplingParams(ignore_eos=True), [EOS])
    assert forced["ignore_eos"] is True and forced["stop_token_ids"] == []
    assert protocol.sampling_params(s, [EOS], stop_in_engine=True)["stop"] == ["\n\n"]


def test_request_repeats_each_prompt_n_times_grouped_by_prompt():
    s = SamplingParams(n=3, max_tokens=8, seed=100)
    r = protocol.generate_request([[1, 2], [3]], s, [0])
    assert r["input_ids"] == [[1, 2], [1, 2], [1, 2], [3], [3], [3]]
    assert r["return_logprob"] is True and isinstance(r["sampling_params"], dict)
    seeded = protocol.generate_request([[1, 2], [3]], s, [0], per_request_seed=True)["sampling_params"]
    assert [p["sampling_seed"] for p in seeded] == [100, 101, 102, 103, 104, 105]
    assert all(p["max_new_tokens"] == 8 for p in seeded)


def test_split_request_keeps_rows_and_their_params_together():
    s = SamplingParams(n=1, seed=0)
    r = protocol.generate_request([[i] for i in range(7)], s, [0], per_request_seed=True)
    parts = protocol.split_request(r, 3)
    assert [p["input_ids"] for p in parts] == [[[0], [1], [2]], [[3], [4], [5]], [[6]]]
    assert [[q["sampling_seed"] for q in p["sampling_params"]] for p in parts] == [[0, 1, 2], [3, 4, 5], [6]]
    assert protocol.split_request(r, 0) == [r] and protocol.split_request(r, 7) == [r]
    shared = protocol.split_request(protocol.generate_request([[1]] * 5, s, [0]), 2)
    assert [len(p["input_ids"]) for p in shared] == [2, 2, 1] and isinstance(shared[2]["sampling_params"], dict)


def test_parse_engine_and_server_outputs_give_the_same_response():
    for item in (engine_output(), server_output()):
        ids, lps, finish = protocol.parse_output(item)
        assert ids == [785, 6722, EOS]  # the stop token is part of the response
        assert lps == [-0.51, -2.25, -0.0031]
        assert finish == "stop"
    assert protocol.parse_output(length_output()) == ([11, 12, 13, 14], [-1.0, -1.5, -0.25, -3.0], "length")


def test_parse_errors_name_the_problem():
    aborted = engine_output()
    aborted["meta_info"]["finish_reason"] = {"type": "abort", "message": "The input is longer than the context."}
    with pytest.raises(SGLangOutputError, match="output 3 was aborted by SGLang: The input is longer"):
        protocol.parse_output(aborted, row=3)
    missing = engine_output()
    del missing["meta_info"]["output_token_logprobs"]
    with pytest.raises(SGLangOutputError, match="no meta_info.output_token_logprobs.*return_logprob"):
        protocol.parse_output(missing)
    wrong = engine_output()
    wrong["output_ids"] = [785, 9999, EOS]
    with pytest.raises(SGLangOutputError, match="output_ids \\(3 tokens\\) disagree"):
        protocol.parse_output(wrong)
    no_lp = length_output()
    no_lp["meta_info"]["output_token_logprobs"][1][0] = None
    with pytest.raises(SGLangOutputError, match="token 1 \\(12\\) has no logprob"):
        protocol.parse_output(no_lp)
    bad_logprobs = {0.7: "logprob 0.7, above 0: not a log-probability", float("nan"): "logprob nan, not a number",
                    "-1.0": "logprob -1.0, not a number"}  # fmt: skip
    for bad, said in bad_logprobs.items():
        item = length_output()
        item["meta_info"]["output_token_logprobs"][2][0] = bad
        with pytest.raises(SGLangOutputError, match=f"token 2 \\(13\\) has {said}"):
            protocol.parse_output(item)
    item = length_output()
    item["meta_info"]["output_token_logprobs"][0][1] = -5
    with pytest.raises(SGLangOutputError, match="token 0 is -5, not a token id"):
        protocol.parse_output(item)
    item = length_output()  # numpy's numbers, as an engine in the process may give them, are numbers
    item["meta_info"]["output_token_logprobs"][0][:2] = [np.float32(-1.0), np.int64(11)]
    assert protocol.parse_output(item)[:2] == ([11, 12, 13, 14], [-1.0, -1.5, -0.25, -3.0])
    with pytest.raises(SGLangOutputError, match="returned 1 outputs for 2 requests"):
        protocol.to_rollout_output([length_output()], expected=2)


def letters(ids):
    return "".join(chr(ord("a") + i) for i in ids)


def test_stop_length_finds_the_token_that_completes_the_stop_string():
    ids = [0, 1, 2, 3, 4, 5]  # "abcdef"
    assert stop_length(ids, letters, ["cd"]) == 4  # through "d"
    assert stop_length(ids, letters, ["zz", "b"]) == 2
    assert stop_length(ids, letters, ["a"]) == 1
    assert stop_length(ids, letters, ["ef"]) == 6
    assert stop_length(ids, letters, ["x"]) is None
    assert stop_length(ids, letters, []) is None


def test_rollout_output_cuts_after_a_stop_string_and_calls_it_stop():
    out = protocol.to_rollout_output([length_output(), engine_output()], expected=2, stops=["mn"], decode=letters)
    # ids 11, 12 are "lm", 13 is "n": "lmn" contains "mn" after the third token
    assert out.token_ids[0] == [11, 12, 13] and out.logprobs[0] == [-1.0, -1.5, -0.25]
    assert out.finish_reasons == ["stop", "stop"]
    assert out.token_ids[1] == [785, 6722, EOS]
    plain = protocol.to_rollout_output([length_output()], expected=1)
    assert plain.token_ids == [[11, 12, 13, 14]] and plain.finish_reasons == ["length"]


def test_buckets_bound_the_bytes_and_drop_tied_duplicates():
    """The buckets the plugin sends (hybridrl.engines.weight_buckets, as it calls it): whole layers,
    closed at the first layer boundary past the limit; tied duplicates and skipped names dropped."""
    embed = torch.zeros(10, 4)  # 160 bytes
    stream = [
        ("model.embed_tokens.weight", embed),
        ("model.layers.0.w", torch.zeros(20)),  # 80
        ("model.layers.0.b", torch.zeros(5)),  # 20
        ("model.norm.weight", torch.zeros(30)),  # 120
        ("lm_head.weight", embed),  # the same memory as the embeddings: tied
    ]

    def names(stream, limit, skip=()):
        return [[n for n, _ in b] for b in weight_buckets(stream, limit, skip=skip, drop_aliases=True)]

    want = [["model.embed_tokens.weight"], ["model.layers.0.w", "model.layers.0.b"], ["model.norm.weight"]]
    assert names(stream, 100) == want  # a layer's tensors stay together
    assert names(stream, 10_000, skip={"model.norm.weight"}) == [
        ["model.embed_tokens.weight", "model.layers.0.w", "model.layers.0.b"]
    ]
    untied = [("a", torch.zeros(100)), ("lm_head.weight", torch.zeros(100))]
    assert names(untied, 100) == [["a"], ["lm_head.weight"]]


def test_model_facts_of_the_tiny_model(tiny_model):
    from transformers import AutoTokenizer

    eos, tied = protocol.model_facts(tiny_model, AutoTokenizer.from_pretrained(tiny_model))
    assert eos == {0, 1} and tied is True  # the tokenizer's EOS and the generation_config's end ids
