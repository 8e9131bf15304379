"""Requests of ``hybridrl serve`` that arrive while the engine is busy, answered together."""

from __future__ import annotations

import queue
import threading


class Batcher:
    """Requests that arrive while the engine is busy are answered together: one call of
    ``generate(prompts, max_tokens)`` for all that wait (up to ``size``), each answer cut to its own
    ``max_tokens`` (the first k tokens of a sample, with their logprobs, are a sample of k tokens)."""

    def __init__(self, generate, size: int):
        self.generate, self.size, self.queue = generate, size, queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="hybridrl-batcher", daemon=True)
        self.thread.start()

    def submit(self, prompt_ids: list[int], max_tokens: int) -> dict:
        """The answer (ids, logprobs, finish reason, version) to one prompt; blocks until it is there."""
        item = {"prompt": prompt_ids, "max_tokens": max_tokens, "done": threading.Event()}
        self.queue.put(item)
        item["done"].wait()
        if "error" in item:
            raise item["error"]
        return item["answer"]

    def _loop(self) -> None:
        while (first := self.queue.get()) is not None:
            items = [first]
            while len(items) < self.size and not self.queue.empty():
                item = self.queue.get()
                if item is None:  # closing: answer these, then stop
                    self.queue.put(None)
                    break
                items.append(item)
            try:
                answers = self.generate([i["prompt"] for i in items], max(i["max_tokens"] for i in items))
                for item, a in zip(items, answers):
                    k = item["max_tokens"]
                    cut = len(a["ids"]) > k
                    item["answer"] = a | {"ids": a["ids"][:k], "logprobs": a["logprobs"][:k]}
                    item["answer"]["finish_reason"] = "length" if cut else a["finish_reason"]
            except Exception as e:  # every request of the call gets the error
                for item in items:
                    item["error"] = e
            for item in items:
                item["done"].set()

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()
