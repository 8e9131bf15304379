"""The batcher that answers waiting requests with one engine call: what goes into each call."""

import threading
import time

from hybridrl_http.batcher import Batcher


def engine(calls):
    def generate(prompts, seeds, max_tokens):
        calls.append(list(prompts))
        answer = lambda p: {"ids": [p[0]] * max_tokens, "logprobs": [0.0] * max_tokens, "finish_reason": "length"}  # noqa: E731
        return [answer(p) for p in prompts]

    return generate


def staggered(batcher, prompts, gap_s=0.2):
    """Each prompt from a caller of its own, ``gap_s`` after the one before; their answers."""
    answers, threads = {}, []
    for p in prompts:
        thread = threading.Thread(target=lambda p=p: answers.update({p: batcher.submit([[p]], [p], 2)}))
        thread.start()
        threads.append(thread)
        time.sleep(gap_s)
    for thread in threads:
        thread.join()
    return answers


def test_without_callers_the_requests_waiting_at_that_moment_go():
    calls = []
    batcher = Batcher(engine(calls), size=8)
    answers = staggered(batcher, [1, 2, 3])
    batcher.close()
    assert calls == [[[1]], [[2]], [[3]]] and batcher.calls == 3 and batcher.rows == 3
    assert answers[2] == [{"ids": [2, 2], "logprobs": [0.0, 0.0], "finish_reason": "length"}]


def test_a_call_waits_for_every_running_caller_and_goes_when_each_has_one_in():
    calls = []
    batcher = Batcher(engine(calls), size=8, wait_s=30, callers=lambda: 3)
    answers = staggered(batcher, [1, 2, 3])  # a call that waited its 30 s would leave the test hanging that long
    batcher.close()
    assert calls == [[[1], [2], [3]]] and batcher.calls == 1 and sorted(answers) == [1, 2, 3]


def test_a_caller_that_never_sends_holds_a_call_no_longer_than_wait_s_after_the_last():
    calls = []
    batcher = Batcher(engine(calls), size=8, wait_s=0.5, callers=lambda: 3)
    answers = staggered(batcher, [1, 2], gap_s=0.05)  # the third caller sends nothing
    batcher.close()
    assert calls == [[[1], [2]]] and answers[1][0]["ids"] == [1, 1]


def test_a_full_call_goes_without_waiting_for_the_rest():
    calls = []
    batcher = Batcher(engine(calls), size=2, wait_s=30, callers=lambda: 4)
    staggered(batcher, [1, 2, 3, 4], gap_s=0.1)
    batcher.close()
    assert calls[0] == [[1], [2]] and sum(len(c) for c in calls) == 4


def test_callers_that_keep_sending_are_waited_for_past_wait_s():
    calls = []
    batcher = Batcher(engine(calls), size=8, wait_s=1.0, callers=lambda: 4)
    staggered(batcher, [1, 2, 3], gap_s=0.6)  # 1.2 s from the first to the third; the fourth never sends
    batcher.close()
    assert calls == [[[1], [2], [3]]]


def test_requests_of_other_settings_wait_for_a_call_of_their_own():
    """Requests that sample with other settings (an evaluation's beside a run's streamed episodes) never
    share a call: each call gets its requests' settings, and a request that came between is not lost."""
    calls = []

    def generate(prompts, seeds, max_tokens, settings):
        calls.append((settings, [p[0] for p in prompts]))
        return [{"ids": [p[0]], "logprobs": [0.0], "finish_reason": "stop"} for p in prompts]

    batcher = Batcher(generate, size=8, wait_s=0.5, callers=lambda: 4)
    answers, threads = {}, []
    for p, settings in [(1, "train"), (2, "eval"), (3, "train"), (4, "eval")]:
        submit = lambda p=p, s=settings: answers.update({p: batcher.submit([[p]], [p], 1, settings=s)})  # noqa: E731
        threads.append(threading.Thread(target=submit))
        threads[-1].start()
        time.sleep(0.05)
    for thread in threads:
        thread.join()
    batcher.close()
    assert calls == [("train", [1, 3]), ("eval", [2, 4])]
    assert all(answers[p][0]["ids"] == [p] for p in (1, 2, 3, 4))
