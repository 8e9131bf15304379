"""The sampler is the run's config, nothing else: a model folder's generation_config.json (top_k,
top_p, min_p, repetition_penalty, no_repeat_ngram_size, temperature, as chat checkpoints ship them)
changes nothing the hf engine samples, on the dynamic and on the static cache."""

import pytest
import torch
from hybridrl_testing import SAMPLING_GENERATION_CONFIG, sampler_check

from hybridrl import plugins
from hybridrl.components import RunContext
from hybridrl.models import load_tokenizer

TOL = 1e-4


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_hf_engine_ignores_the_generation_config(tiny_model, tmp_path, cache):
    assert SAMPLING_GENERATION_CONFIG["top_k"] == 5  # the folder under test sets every field
    ctx = RunContext(tiny_model, load_tokenizer(tiny_model), torch.device("cpu"), torch.float32, 0, tmp_path)
    cls = plugins.lookup("rollout engine", "hf")
    engine = cls(cls.Options(cache=cache), ctx)
    diff, distinct = sampler_check(engine, tiny_model)
    assert diff < TOL
    assert distinct > SAMPLING_GENERATION_CONFIG["top_k"]  # nothing truncated the distribution


def test_hf_engine_keeps_the_end_ids_of_the_generation_config(tiny_model, tmp_path):
    ctx = RunContext(tiny_model, load_tokenizer(tiny_model), torch.device("cpu"), torch.float32, 0, tmp_path)
    cls = plugins.lookup("rollout engine", "hf")
    assert cls(cls.Options(), ctx).eos_ids == {0, 1}  # <|im_end|> and the padding token, as in the file
