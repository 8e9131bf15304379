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


def test_with_branches_adds_a_row_per_earlier_branch_with_its_episodes_score_and_group():
    from hybridrl.batch import with_branches

    out = RolloutOutput([[7, 8], [9]], [[-1.0, -2.0], [-3.0]], ["stop", "length"], [[1, 0], [1]])
    batch = Batch.from_rollout([[5], [6]], out, 1, PAD)
    batch["group_ids"], batch["scores"] = torch.tensor([0, 0]), torch.tensor([1.0, 0.0])
    batch["answer"] = ["a", "b"]
    # the first episode forked twice: two earlier branches, each its own prompt and tokens
    batch["branches"] = [
        [{"prompt": [1, 2, 3], "ids": [4], "logprobs": [-0.5], "sampled": [1], "finish": "stop"},
         {"prompt": [2], "ids": [3, 3, 3], "logprobs": [-0.25, 0.0, -0.5], "sampled": [1, 0, 1], "finish": "length"}],
        [],
    ]  # fmt: skip
    rows = with_branches(batch, PAD)
    assert "branches" not in rows and rows["branch_row"].tolist() == [False, False, True, True]
    assert rows["scores"].tolist() == [1.0, 0.0, 1.0, 1.0] and rows["group_ids"].tolist() == [0, 0, 0, 0]
    assert rows["answer"] == ["a", "b", "a", "a"] and rows["finish_reason"] == ["stop", "length", "stop", "length"]
    wants = [([5], [7, 8]), ([6], [9]), ([1, 2, 3], [4]), ([2], [3, 3, 3])]
    for i, (prompt, response) in enumerate(wants):
        p, r = rows["prompt_mask"][i].bool(), rows["response_attention_mask"][i].bool()
        assert rows["prompts"][i][p].tolist() == prompt and rows["responses"][i][r].tolist() == response
    assert rows["response_mask"][3].tolist() == [1, 0, 1] and rows["rollout_logprobs"][3].tolist() == [-0.25, 0.0, -0.5]
    assert rows["response_mask"][0].tolist() == [1, 0, 0]  # the episode's own row as it was, padded
    # no branches at all: the rows as they were, flagged
    batch["branches"] = [[], []]
    assert with_branches(batch, PAD)["branch_row"].tolist() == [False, False]
    del batch.lists["branches"]
    assert with_branches(batch, PAD) is batch
