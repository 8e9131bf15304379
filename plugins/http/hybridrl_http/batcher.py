"""Requests of an OpenAI-compatible server that arrive while the engine is busy, answered
together by one engine call (``hybridrl serve``, the agent gateway of hybridrl-agents)."""

from __future__ import annotations

import queue
import threading
import time

GAPS = 20  # an engine call waits at most this many wait_s for callers that keep sending


class Batcher:
    """One thread calls the engine, ``generate(prompts, seeds, max_tokens)`` -> one answer dict
    (``ids``, ``logprobs``, ``finish_reason``, ...) per prompt: requests that wait are sampled
    together (up to ``size`` prompts), each prompt with its own seed, each request cut to its own
    ``max_tokens`` (the first k tokens of a sample, with their logprobs, are a sample of k tokens).
    Requests submitted with ``settings`` (what else they sample with, compared with ==) share a call
    only with requests of equal settings, which ``generate`` then gets as ``settings=``."""

    def __init__(self, generate, size: int, wait_s: float = 0.0, callers=None):
        """``callers()``: how many callers may send a request, each one at a time (the agent gateway's
        running episodes): an engine call waits for theirs while they keep coming (``wait_s`` at most
        between two, 20 x ``wait_s`` in all), and goes as soon as each has one in; without it, the
        requests waiting at that moment go."""
        self.generate, self.size, self.queue = generate, size, queue.Queue()
        self.wait_s, self.callers = wait_s, callers
        self.calls = self.rows = 0  # engine calls made, prompts they answered
        self.later: list[dict] = []  # requests taken from the queue while a call of other settings gathered
        self.thread = threading.Thread(target=self._loop, name="hybridrl-engine-calls", daemon=True)
        self.thread.start()

    def submit(self, prompts: list[list[int]], seeds: list[int], max_tokens: int, settings=None) -> list[dict]:
        """The answers to one request's ``prompts``; blocks until they are there."""
        item = {"prompts": prompts, "seeds": seeds, "max_tokens": max_tokens, "settings": settings}
        item["done"] = threading.Event()
        self.queue.put(item)
        item["done"].wait()
        if "error" in item:
            raise item["error"]
        return item["answers"]

    def _loop(self) -> None:
        while (first := self.later.pop(0) if self.later else self.queue.get()) is not None:
            items, start = [first], time.monotonic()
            items += [i for i in self.later if i["settings"] == first["settings"]]  # waited for this call
            self.later = [i for i in self.later if i["settings"] != first["settings"]]
            deadline = start + self.wait_s
            while sum(len(i["prompts"]) for i in items) < self.size:
                if self.callers is not None and len(items) + len(self.later) >= self.callers():
                    break  # every caller is waiting: nobody else will send
                left = deadline - time.monotonic()
                try:
                    item = self.queue.get(timeout=left) if left > 0 else self.queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self.queue.put(None)
                    break
                if item["settings"] != first["settings"]:  # for a call of its own, after this one
                    self.later.append(item)
                    continue
                items.append(item)
                deadline = min(time.monotonic() + self.wait_s, start + GAPS * self.wait_s)
            try:
                prompts = [p for i in items for p in i["prompts"]]
                self.calls, self.rows = self.calls + 1, self.rows + len(prompts)
                seeds = [s for i in items for s in i["seeds"]]
                settings = {} if first["settings"] is None else {"settings": first["settings"]}
                answers = self.generate(prompts, seeds, max(i["max_tokens"] for i in items), **settings)
                for item in items:
                    mine, answers = answers[: len(item["prompts"])], answers[len(item["prompts"]) :]
                    item["answers"] = [cut_length(a, item["max_tokens"]) for a in mine]
            except Exception as e:  # every request of the call gets the error
                for item in items:
                    item["error"] = e
            for item in items:
                item["done"].set()

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()


def cut_length(answer: dict, k: int) -> dict:
    """The first ``k`` tokens of a sample are a sample of ``k`` tokens (with their logprobs)."""
    if len(answer["ids"]) <= k:
        return answer
    return answer | {"ids": answer["ids"][:k], "logprobs": answer["logprobs"][:k], "finish_reason": "length"}
