"""Batch: concatenating rollouts of different prompt and response lengths, and taking whole groups."""

import pytest
import torch

from hybridrl.batch import Batch, first_groups
from hybridrl.components import RolloutOutput

PAD = 0


def rollout(prompts, responses, n, first_group=0):
    out = RolloutOutput(
        responses, [[-0.5 * (i + 1)] * len(r) for i, r in enumerate(responses)], ["stop"] * len(responses)
    )
    batch = Batch.from_rollout(prompts, out, n, PAD)
    batch["group_ids"] = batch["group_ids"] + first_group
    batch["scores"] = torch.arange(len(responses), dtype=torch.float32) + first_group
    batch["response_text"] = [f"r{first_group}.{i}" for i in range(len(responses))]
    return batch


def test_cat_pads_prompts_left_and_responses_right():
    a = rollout([[5, 6]], [[7], [8, 9]], n=2)  # P = 2, T = 2
    b = rollout([[1, 2, 3]], [[4, 4, 4], [5]], n=2, first_group=1)  # P = 3, T = 3
    both = Batch.cat([a, b], PAD)
    assert both["prompts"].tolist() == [[0, 5, 6], [0, 5, 6], [1, 2, 3], [1, 2, 3]]
    assert both["prompt_mask"].tolist() == [[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]]
    assert both["responses"].tolist() == [[7, 0, 0], [8, 9, 0], [4, 4, 4], [5, 0, 0]]
    assert both["response_mask"].tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0]]
    assert both["rollout_logprobs"][1].tolist() == [-1.0, -1.0, 0.0]
    assert both["group_ids"].tolist() == [0, 0, 1, 1] and both["scores"].tolist() == [0, 1, 1, 2]
    assert both["response_text"] == ["r0.0", "r0.1", "r1.0", "r1.1"]
    # each row's real tokens, read through its attention mask, are its prompt and its response
    wants = [[5, 6, 7], [5, 6, 8, 9], [1, 2, 3, 4, 4, 4], [1, 2, 3, 5]]
    for ids, mask, want in zip(both.input_ids.tolist(), both.attention_mask.tolist(), wants):
        assert [t for t, m in zip(ids, mask) if m] == want


def test_cat_skips_empty_batches_and_refuses_different_entries():
    a = rollout([[5, 6]], [[7], [8, 9]], n=2)
    empty = a.select([])
    assert Batch.cat([empty, a, empty], PAD)["responses"].tolist() == a["responses"].tolist()
    b = rollout([[1]], [[2]], n=1)
    del b.lists["response_text"]
    with pytest.raises(ValueError, match="entries differ: \\['response_text'\\]"):
        Batch.cat([a, b], PAD)


def test_first_groups_keeps_whole_groups_in_order():
    batch = Batch.cat([rollout([[1], [2]], [[3]] * 4, n=2), rollout([[4]], [[5], [6]], n=2, first_group=2)], PAD)
    assert batch.groups() == 3
    assert first_groups(batch, 2)["group_ids"].tolist() == [0, 0, 1, 1]
    assert first_groups(batch, 5) is batch
    dropped = batch.select([0, 1, 4, 5])  # group 1 filtered out
    assert first_groups(dropped, 2)["scores"].tolist() == [0, 1, 2, 3]
