"""The learner of ``hybridrl serve``: trains the policy on users' ratings, on its own thread.

Once ``online.update_every`` new ratings are in (or the oldest is ``online.update_every_s`` old),
it makes one update through the trainer, the way ``Trainer.step`` does after its rollout: the
answers as sampled (token in, token out) in a batch whose scores are the ratings (the
``user_rating`` reward); the advantages, rating - baseline on every token of an answer, with a
baseline per answer (:func:`baselines`, :func:`baseline_advantages`), handed to ``Trainer.train_on``
in place of the algorithm's estimator (then the logprobs, the algorithm's policy loss with its KL
term and its off-policy correction for answers of older versions); then ``Trainer.sync`` (the
engine session counts the new version under the lock that generation takes), ``Trainer.save``,
``Trainer.log``. Its progress (the last rating trained on, the running baseline) is in the
checkpoint: a restart continues from the last saved version and trains again on what came after.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import defaultdict

import torch

from hybridrl.batch import Batch
from hybridrl.components import RolloutOutput
from hybridrl.metrics import Timer


def prompt_groups(prompts: list[list[int]]) -> list[int]:
    """A group id for each answer: answers to the same prompt share one, numbered in order of appearance."""
    first: dict[tuple, int] = {}
    return [first.setdefault(tuple(p), len(first)) for p in prompts]


def baselines(scores: list[float], groups: list[int], mode: str, running: float | None) -> list[float]:
    """The baseline of each answer (``online.baseline``). ``leave_one_out``: the mean score of the
    other answers of its group (to the same prompt) among these (RLOO, Ahmadian et al. 2024);
    ``running``: ``running``, the mean of earlier ratings; ``auto``: leave-one-out where another
    answer of the group is here, running otherwise. Without earlier ratings (the first update) the
    running baseline is the mean of these."""
    members = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    fallback = running if running is not None else sum(scores) / len(scores)
    out = []
    for i, g in enumerate(groups):
        others = [scores[j] for j in members[g] if j != i]
        out.append(sum(others) / len(others) if others and mode != "running" else fallback)
    return out


def baseline_advantages(scores: torch.Tensor, baseline: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """score - baseline on every token of a response: (B,), (B,), (B, T) -> (B, T), 0 where masked."""
    return (scores.float() - baseline.to(scores.device).float())[:, None] * mask.float()


class Learner:
    """Trains the trainer's policy on users' ratings, on its own thread (see the module docstring)."""

    def __init__(self, trainer, store):
        self.trainer, self.store, self.options = trainer, store, trainer.config.section("online")
        self.consumed = 0  # sequence number of the last rating trained on
        self.rating_sum, self.rating_count = 0.0, 0  # of the ratings trained on: the running baseline
        self.wake, self.stopping = threading.Event(), threading.Event()
        self.learning, self.error = False, None
        self.last: dict[str, float] = {}  # the metrics of the last update
        self.thread = threading.Thread(target=self._loop, name="hybridrl-learner", daemon=True)

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "rating_sum": self.rating_sum, "rating_count": self.rating_count}

    def load_state_dict(self, state: dict) -> None:
        self.consumed, self.rating_sum, self.rating_count = (
            state["consumed"],
            state["rating_sum"],
            state["rating_count"],
        )

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()
        if self.thread.is_alive():
            self.thread.join()

    def due(self) -> list[dict]:
        """The ratings of the next update, or [] when it is not due."""
        o = self.options
        rows = self.store.pending(self.consumed, o.max_batch)
        if len(rows) >= o.update_every:
            return rows
        if rows and o.update_every_s and time.time() - rows[0]["created"] >= o.update_every_s:
            return rows
        return []

    def _loop(self) -> None:
        while not self.stopping.is_set():
            self.wake.wait(timeout=1.0)
            self.wake.clear()
            rows = self.due()
            if rows and not self.stopping.is_set():
                try:
                    self.update(rows)
                except Exception as e:  # the server keeps answering with the last good weights
                    self.error = f"{type(e).__name__}: {e}"
                    version = self.trainer.run.session.version
                    print(f"error: online update after version {version} failed: {self.error}", file=sys.stderr)
                    self.stopping.set()

    def batch(self, rows: list[dict]) -> Batch:
        """The rated answers as sampled, with their ratings (``rating``), a group per prompt
        (``group_ids``) and the texts the loggers' samples show."""
        tokenizer = self.trainer.run.tokenizer
        prompts = [r["prompt_ids"] for r in rows]
        out = RolloutOutput(
            [r["response_ids"] for r in rows], [r["logprobs"] for r in rows], [r["finish_reason"] for r in rows]
        )
        batch = Batch.from_rollout(prompts, out, 1, tokenizer.pad_token_id)
        batch["group_ids"] = torch.tensor(prompt_groups(prompts))
        batch["rating"] = torch.tensor([r["rating"] for r in rows], dtype=torch.float32)
        batch["response_text"] = [r["text"] for r in rows]
        batch["prompt_text"] = tokenizer.batch_decode(prompts)
        batch["answer"] = batch["metadata"] = [None] * len(rows)
        return batch

    def update(self, rows: list[dict]) -> dict[str, float]:
        """One update on ``rows``: scores, baselines and advantages, the trainer's update, the engine's
        new weights, a checkpoint (``online.save_every``), the metrics logged."""
        t, run, o = self.trainer, self.trainer.run, self.options
        self.learning = True
        try:
            step = run.session.updates + 1  # the policy's updates so far, counted by the engine session
            timer = Timer(run.ctx.device)
            batch = self.batch(rows)
            with timer("reward"):
                metrics = run.rewards.score(batch)  # reward 'user_rating': batch["scores"]
            scores = batch["scores"].tolist()
            running = self.rating_sum / self.rating_count if self.rating_count else None
            baseline = torch.tensor(baselines(scores, batch["group_ids"].tolist(), o.baseline, running))
            advantages = baseline_advantages(batch["scores"], baseline, batch["response_mask"])
            batch = batch.to(run.ctx.device)
            # the batch, or None: trainer.on_nonfinite skipped it
            trained, _ = t.train_on(batch, step, timer, advantages=advantages)
            self.consumed = rows[-1]["seq"]
            self.rating_sum += sum(scores)
            self.rating_count += len(scores)
            with timer("sync"):
                t.sync()  # the session stamps the new version under the lock of the sync
            if step % o.save_every == 0:
                with timer("save"):
                    t.save(step)  # with the learner's state: a restart continues after these ratings
            metrics |= trained | timer.metrics() | self.metrics(rows, step)
            self.last = t.log(step, metrics, batch)
            return self.last
        finally:
            self.learning = False

    def metrics(self, rows: list[dict], step: int) -> dict[str, float]:
        """What the dashboard shows of serving: versions, staleness, ratings (figures, no text)."""
        counts = self.store.counts(self.consumed, time.time() - 600)
        return {
            "online/version": float(step),
            "online/ratings": float(len(rows)),
            "online/staleness_mean": sum(step - 1 - r["version"] for r in rows) / len(rows),
            "online/rating_mean_all": float(counts["mean"] or 0.0),
            "online/ratings_per_min": counts["recent"] / 10.0,
            "online/answers": float(counts["answers"]),
            "online/pending": float(counts["pending"]),
        }
