"""The third-party plugin of docs/rewards.md works as written."""

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

DOC = Path(__file__).resolve().parents[3] / "docs" / "rewards.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def load_module(code: str, path: Path):
    path.write_text(code)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("block", [0, 1], ids=["standalone", "preset-of-reranker"])
def test_the_documented_bge_plugin_scores_like_the_built_in_reranker(
    block, xlmr_reranker, tmp_path, ctx, make_reward, make_batch, register_plugin
):
    from hybridrl import plugins

    prompts = ["What is the capital of France?", "Name a colour."]
    responses = ["Paris is the capital.", "Blue."]
    batch = make_batch(prompts, responses, messages=[[{"role": "user", "content": p}] for p in prompts])
    expected = make_reward("reranker", model=xlmr_reranker).score(batch)
    register_plugin(load_module(python_blocks()[block], tmp_path / "hybridrl_bge.py"), name="bge")
    cls = plugins.lookup("reward function", "bge_reranker")
    reward = cls(cls.Options(model=xlmr_reranker), ctx)
    torch.testing.assert_close(torch.as_tensor(reward.score(batch)), expected, atol=1e-5, rtol=1e-5)


def test_the_documented_request_is_valid_json_with_one_entry_per_response():
    text = DOC.read_text()
    request = json.loads(re.search(r"`POST /score`.*?```json\n(.*?)```", text, flags=re.S).group(1))
    assert {len(v) for v in request.values()} == {len(request["responses"])}
