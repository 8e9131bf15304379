"""Rule-based rewards: answer match, format checks and reasoning-gym verifiers."""

from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import Field

from hybridrl.components import Options, RewardFunction
from hybridrl.hookspecs import hookimpl

NUMBER = r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?"


def extract_answer(text: str, method: str = "auto", pattern: str | None = None) -> str | None:
    """The answer in a response.

    ``boxed``: the last ``\\boxed{...}``; ``tag``: the last ``<answer>...</answer>``;
    ``last_number``: the last number; ``regex``: the first group of the last match of
    ``pattern``; ``auto``: boxed, then tag, then "answer is/: X", then the last number.
    """
    if method == "regex":
        found = re.findall(pattern, text, flags=re.S)
        return (found[-1] if isinstance(found[-1], str) else found[-1][0]).strip() if found else None
    if method in ("boxed", "auto"):
        found = re.findall(r"\\boxed\{([^{}]*)\}", text)
        if found:
            return found[-1].strip()
    if method in ("tag", "auto"):
        found = re.findall(r"<answer>(.*?)</answer>", text, flags=re.S)
        if found:
            return found[-1].strip()
    if method == "auto":
        found = re.findall(r"answer(?: is|:)\s*\$?(" + NUMBER + ")", text, flags=re.I)
        if found:
            return found[-1]
    if method in ("last_number", "auto"):
        found = re.findall(NUMBER, text)
        if found:
            return found[-1]
    return None


def to_number(text: str | None) -> float | None:
    if text is None:
        return None
    t = text.strip().rstrip(".").replace(",", "").replace("$", "")
    try:
        if "/" in t:
            num, den = t.split("/", 1)
            return float(num) / float(den)
        return float(t)
    except (ValueError, ZeroDivisionError):
        return None


class AnswerMatch(RewardFunction):
    """1.0 when the extracted answer equals the ground truth (numerically, or as text)."""

    class Options(Options):
        extract: Literal["auto", "boxed", "tag", "last_number", "regex"] = Field(
            "auto", description="How to find the answer in the response."
        )
        pattern: str | None = Field(None, description="Regex for extract=regex; group 1 is the answer.")
        compare: Literal["numeric", "exact"] = Field(
            "numeric", description="numeric: |a - b| <= tolerance; exact: equal strings after strip."
        )
        tolerance: float = Field(1e-6, ge=0)
        wrong: float = Field(0.0, description="Score of a wrong or missing answer.")

    @classmethod
    def needs(cls, options):
        return {"answer"}

    def score(self, batch):
        o = self.options
        out = []
        for response, truth in zip(batch["response_text"], batch["answer"]):
            if truth is None:
                raise ValueError("answer_match needs ground truth: set data.answer_column to the answer field.")
            got = extract_answer(response, o.extract, o.pattern)
            if o.compare == "exact":
                ok = got is not None and got.strip() == str(truth).strip()
            else:
                a, b = to_number(got), to_number(str(truth))
                ok = a is not None and b is not None and math.isclose(a, b, rel_tol=0, abs_tol=o.tolerance)
            out.append(1.0 if ok else o.wrong)
        return out


class FormatCheck(RewardFunction):
    """1.0 when the response matches a regex (e.g. an answer tag), else 0."""

    class Options(Options):
        pattern: str = Field(description="Python regex the response must match (re.search, DOTALL).")
        full_match: bool = Field(False, description="Require the whole stripped response to match.")

    def score(self, batch):
        rx = re.compile(self.options.pattern, re.S)
        match = rx.fullmatch if self.options.full_match else rx.search
        return [1.0 if match(r.strip() if self.options.full_match else r) else 0.0 for r in batch["response_text"]]


class ReasoningGymVerifier(RewardFunction):
    """The task's own ``score_answer`` from the reasoning-gym package, on the extracted answer.

    Rows must come from the ``reasoning_gym`` prompt source (their metadata names the task).
    """

    class Options(Options):
        extract: Literal["auto", "boxed", "tag", "last_number", "none"] = Field(
            "auto", description="How to find the answer in the response; none: the whole response."
        )

    @classmethod
    def needs(cls, options):
        return {"answer", "metadata"}

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self._datasets = {}

    def score(self, batch):
        from hybridrl.builtin.datasets import require_reasoning_gym

        rg = require_reasoning_gym()
        out = []
        for response, truth, meta in zip(batch["response_text"], batch["answer"], batch["metadata"]):
            task = (meta or {}).get("source_dataset")
            if task is None:
                raise ValueError(
                    "reasoning_gym reward: rows carry no reasoning-gym metadata; use data.source: reasoning_gym."
                )
            if task not in self._datasets:
                self._datasets[task] = rg.get_score_answer_fn(task)
            got = response if self.options.extract == "none" else extract_answer(response, self.options.extract)
            entry = {"answer": truth, "metadata": meta}
            out.append(float(self._datasets[task](got, entry)) if got is not None else 0.0)
        return out


class EnvironmentReward(RewardFunction):
    """The rewards the environment gave a multi-turn trajectory, summed over its turns
    (``Observation.reward``; 0 for single-turn rollouts)."""

    def score(self, batch):
        return batch.get("env_reward", [0.0] * len(batch["response_text"]))


@hookimpl
def register_reward_functions(register):
    register("answer_match", AnswerMatch)
    register("environment", EnvironmentReward)
    register("format", FormatCheck)
    register("reasoning_gym", ReasoningGymVerifier)
