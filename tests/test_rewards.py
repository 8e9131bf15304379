"""Rule-based rewards, and reasoning-gym's verifier on real generated problems."""

import pytest

from hybridrl import plugins
from hybridrl.batch import Batch
from hybridrl.builtin.rewards import extract_answer, to_number


def make(responses, answers=None, metadata=None):
    b = Batch()
    b["response_text"] = responses
    b["answer"] = answers or [None] * len(responses)
    b["metadata"] = metadata or [None] * len(responses)
    return b


def reward(name, **options):
    cls = plugins.lookup("reward function", name)
    return cls(cls.Options(**options), ctx=None)


@pytest.mark.parametrize(
    "text, method, expected",
    [
        ("so the answer is \\boxed{42}.", "auto", "42"),
        ("<answer> 7 </answer>", "auto", "7"),
        ("I think 3 + 4, the answer is 7 and not 8", "auto", "7"),
        ("3 + 4 = 7", "auto", "7"),
        ("-12", "last_number", "-12"),
        ("1,234 apples", "last_number", "1,234"),
        ("no digits", "auto", None),
        ("Result: abc", "regex", None),
    ],
)
def test_extract_answer(text, method, expected):
    assert extract_answer(text, method, pattern=r"Result: (\d+)") == expected


def test_to_number():
    assert to_number("1,234") == 1234 and to_number("3/4") == 0.75 and to_number("7.") == 7
    assert to_number("x") is None and to_number(None) is None


def test_answer_match_numeric_and_exact():
    b = make(["It is 7.0", "It is 8", "nothing", "\\boxed{ab}"], ["7", "7", "7", "ab"])
    assert reward("answer_match").score(b) == [1.0, 0.0, 0.0, 0.0]
    assert reward("answer_match", compare="exact", extract="boxed").score(b) == [0.0, 0.0, 0.0, 1.0]
    assert reward("answer_match", wrong=-1.0).score(b)[1] == -1.0


def test_answer_match_without_ground_truth_says_what_to_set():
    with pytest.raises(ValueError, match="data.answer_column"):
        reward("answer_match").score(make(["7"]))


def test_format_reward():
    r = reward("format", pattern=r"-?\d+", full_match=True)
    assert r.score(make(["42", " -3 ", "42 apples"])) == [1.0, 1.0, 0.0]
    assert reward("format", pattern=r"<answer>").score(make(["x <answer>1</answer>", "1"])) == [1.0, 0.0]


def test_reasoning_gym_verifier_on_generated_problems():
    import reasoning_gym

    ds = reasoning_gym.create_dataset("chain_sum", size=3, seed=5, min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    rows = [ds[i] for i in range(3)]
    right = [f"The result is {row['answer']}" for row in rows]
    wrong = [f"{int(row['answer']) + 1}" for row in rows]
    b = make(right + wrong, [r["answer"] for r in rows] * 2, [r["metadata"] for r in rows] * 2)
    assert reward("reasoning_gym", extract="last_number").score(b) == [1.0] * 3 + [0.0] * 3


def test_reasoning_gym_verifier_needs_its_metadata():
    with pytest.raises(ValueError, match="data.source: reasoning_gym"):
        reward("reasoning_gym").score(make(["1"], ["1"], [{}]))


def test_a_reward_with_too_few_scores_is_an_error_line_naming_it():
    """One score for two responses: a StageError (printed as one line by the CLI), not a traceback."""
    import torch

    from hybridrl.config import RewardConfig
    from hybridrl.errors import StageError
    from hybridrl.rewards import Rewards

    class OneScore:
        def score(self, batch):
            return [1.0]

    rewards = Rewards([(RewardConfig(function="judge"), OneScore())], torch.device("cpu"))
    batch = make(["7", "77"])
    batch["response_mask"] = torch.tensor([[1, 0], [1, 1]])
    with pytest.raises(StageError, match=r"reward 'judge' \(function 'judge'\) failed in score: it returned 1 scores"):
        rewards.score(batch)
