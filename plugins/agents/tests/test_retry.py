"""The ``retry`` environment: a wrong answer gets the feedback turn, a right one ends the trajectory."""

from __future__ import annotations

from hybridrl import plugins


def retry_env(**options):
    cls = plugins.lookup("environment", "retry")  # registered by this plugin
    return cls(cls.Options(check="answer_match", check_options={"extract": "last_number"}, **options), None)


def test_a_wrong_answer_gets_the_feedback_and_a_right_one_ends_the_trajectory():
    env = retry_env(feedback="No. Try again.")
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    state = env.reset({"question": "What is 3 + 4?", "answer": "7"}, messages)
    wrong = env.step(state, "It is 8.")
    assert not wrong.done and wrong.messages == [{"role": "user", "content": "No. Try again."}]
    assert wrong.info == {"retries": 1}
    right = env.step(state, "Sorry: 3 + 4 = 7")  # the last number is the answer
    assert right.done and right.messages == [] and right.info == {"right": 1}


def test_the_threshold_decides_what_counts_as_right():
    state = {"row": {"answer": "7"}, "messages": []}
    assert not retry_env().step(state, "about 7.5").done  # answer_match scores it 0
    assert retry_env(threshold=0.0).step(state, "about 7.5").done  # any score is right
