"""The ``python`` reward: a function from a Python file, written for verl (``compute_score``) or for
TRL (a reward function), used as it is.

Each response is one call, run in worker processes (:mod:`hybridrl_reward_python.function_pool`)
with a time limit, so that a call that hangs or crashes its process costs that response's score,
names it, and never stops the run; a reward that fails for many responses stops the step instead.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from hybridrl.components import INPUT_PATH, Options, RewardFunction
from hybridrl.errors import ConfigError
from hybridrl_reward_python.function_pool import FunctionLoadError, FunctionPool

#: what verl's reward managers pass to a custom ``compute_score``, by keyword
VERL_KEYWORDS = ("data_source", "solution_str", "ground_truth", "extra_info")
#: what TRL's GRPOTrainer passes to a reward function by keyword, besides the dataset's other columns
TRL_KEYWORDS = ("prompts", "completions", "completion_ids")
#: the statistics the trainer logs under reward/<name>/: a dict return's extras may not take them
RESERVED = {"mean", "std", "min", "max", "shaped_mean", "errors", "not_applicable"}
KEYWORD_KINDS = ("POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY")
SHOWN_FAILURES = 3  # failed responses printed per step, the others counted


def accepted_keywords(params: list | None, given: tuple[str, ...], main: str, where: str) -> tuple[str, ...] | None:
    """Which of the keywords ``given`` a function with ``params`` (``(name, kind, has_default)``, as
    :func:`hybridrl_reward_python.function_pool.describe` gives them) takes: None for all of them
    (it has ``**kwargs``, or Python cannot tell). ConfigError when it cannot be called so: a
    parameter it requires that is not given, a positional-only one, or no ``main`` (the response)."""
    if params is None:
        return None
    names = [name for name, kind, _ in params if kind in KEYWORD_KINDS]
    for name, kind, has_default in params:
        if kind == "POSITIONAL_ONLY" and not has_default:
            raise ConfigError(f"{where}: its parameter '{name}' is positional-only; the call passes keywords only.")
        if kind in KEYWORD_KINDS and not has_default and name not in given:
            raise ConfigError(
                f"{where} requires '{name}', which the call does not give: it passes {', '.join(given)} by keyword. "
                "Give it a default, or choose the other style (style: verl or trl)."
            )
    if any(kind == "VAR_KEYWORD" for _, kind, _ in params):
        return None
    if main not in names:
        raise ConfigError(
            f"{where} takes no '{main}' (its parameters: {', '.join(p[0] for p in params) or 'none'}), so it "
            f"never sees the response. Name that parameter '{main}', or choose the other style (style: verl or trl)."
        )
    return tuple(name for name in given if name in names)


def verl_score(value) -> tuple[float, dict[str, float]]:
    """A ``compute_score`` return: a number, or a dict with ``score`` and extras (their numbers kept)."""
    extras = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"it returned a dict without 'score' (keys: {', '.join(map(str, value))}).")
        extras = {k: float(v) for k, v in value.items() if k != "score" and is_number(v)}
        value = value["score"]
    if not is_number(value):
        raise ValueError(f"it returned {value!r}, not a number.")
    return float(value), extras


def trl_score(value) -> float | None:
    """A TRL reward function's answer to one completion: a list of one number, or of one None."""
    if not isinstance(value, list | tuple) or len(value) != 1:
        raise ValueError(f"it returned {value!r}, not a list with one score per completion.")
    if value[0] is not None and not is_number(value[0]):
        raise ValueError(f"it returned {value!r}, not a list of numbers (or None).")
    return None if value[0] is None else float(value[0])


def is_number(value) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, str)


class PythonReward(RewardFunction):
    """A reward function from a Python file: verl's ``compute_score(data_source, solution_str,
    ground_truth, extra_info)`` or a TRL reward function ``f(completions, **kwargs) -> list[float]``,
    called once per response in worker processes, each call within ``timeout_s``."""

    class Options(Options):
        path: str = Field(
            description="The Python file: FILE.py, or FILE.py:FUNCTION. A relative path is looked up beside the "
            "config file, then in the current directory. The file is imported in the worker processes only.",
            json_schema_extra=INPUT_PATH,
        )
        function_name: str = Field(
            "compute_score", description="The function in the file (verl's default name); FILE.py:FUNCTION sets it."
        )
        style: Literal["verl", "trl"] = Field(
            "verl",
            description="verl: f(data_source, solution_str, ground_truth, extra_info) by keyword, returning a number "
            "or a dict with 'score' (its other numbers logged as reward/<name>/<key>). trl: f(prompts=[...], "
            "completions=[...], completion_ids=[...], <each other row field>=[...]) with lists of one response, "
            "returning a list of one number or None (not applicable: scores 0).",
        )
        kwargs: dict[str, Any] = Field(
            default_factory=dict, description="More keyword arguments for every call (verl's reward_kwargs)."
        )
        timeout_s: float = Field(
            30.0, gt=0, description="Seconds one response's call may take; then its worker is killed and replaced."
        )
        workers: int = Field(4, gt=0, description="Worker processes that run calls in parallel.")
        max_error_rate: float = Field(
            0.1,
            ge=0,
            le=1,
            description="A response whose call fails (raises, times out, crashes its worker) scores 0 and is "
            "counted in reward/<name>/errors; when more than this fraction of a step's responses fail, the step "
            "fails naming them. 0: any failure fails the step (as verl does).",
        )

        @model_validator(mode="before")
        @classmethod
        def _split_path(cls, values):
            path = values.get("path") if isinstance(values, dict) else None
            if isinstance(path, str) and ":" in Path(path).name:
                file, _, name = path.rpartition(":")
                if values.get("function_name") not in (None, name):
                    raise ValueError(f"path names function '{name}' and function_name '{values['function_name']}'.")
                values = {**values, "path": file, "function_name": name}
            return values

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        o = options
        self.where = f"reward function 'python' ({o.path}:{o.function_name})"
        file = Path(o.path).expanduser()
        if not file.is_file():
            raise ConfigError(
                f"reward function 'python': no file {o.path} (a relative path is looked up beside the config file, "
                f"then in the current directory, {Path.cwd()})."
            )
        try:  # the file imported, the function found: before any model loads
            self.pool = FunctionPool(file.resolve(), o.function_name, o.workers, start_timeout_s=max(120, o.timeout_s))
        except FunctionLoadError as e:
            raise ConfigError(f"reward function 'python': {e}") from None
        given = (*(VERL_KEYWORDS if o.style == "verl" else TRL_KEYWORDS), *o.kwargs)
        main = "solution_str" if o.style == "verl" else "completions"
        params, self.required = self.pool.signature, ()
        try:
            if o.style == "verl":
                self.keywords = accepted_keywords(params, given, main, self.where)
            else:  # parameters named after the rows' fields (solution=...) are checked against the first rows
                names = tuple(name for name, kind, _ in params or () if kind in KEYWORD_KINDS)
                self.keywords = accepted_keywords(params, given + names, main, self.where)
                self.required = tuple(n for n, kind, default in params or () if kind in KEYWORD_KINDS and not default)
        except ConfigError:
            self.pool.close()
            raise
        self._metrics: dict[str, float] = {}

    def calls(self, batch) -> list[dict]:
        """The keyword arguments of each response's call."""
        o, n = self.options, len(batch["response_text"])
        rows = batch.get("row") or [{}] * n
        if o.style == "verl":

            def turns(trajectory: list[dict] | None) -> int:
                """verl's num_turns: 2 for a single-turn rollout (SingleTurnAgentLoop), else the prompt, each
                assistant turn and each round of observations (ToolAgentLoop: user_turns + assistant_turns + 1)."""
                if trajectory is None:
                    return 2
                said = [m["role"] == "assistant" for m in trajectory]
                return 1 + sum(a or i == 0 or said[i - 1] for i, a in enumerate(said))

            # verl's reward managers add num_turns and the row's rollout reward scores to extra_info
            # (NaiveRewardManager.__call__, verl/workers/reward_manager/naive.py); a copy, the row unchanged
            every = [
                {
                    "data_source": row.get("data_source"),
                    "solution_str": text,
                    "ground_truth": truth,
                    "extra_info": {
                        **(row.get("extra_info") or {}),
                        "num_turns": turns(trajectory),
                        "rollout_reward_scores": row.get("reward_scores", {}),
                    },
                    **o.kwargs,
                }
                for row, text, truth, trajectory in zip(
                    rows, batch["response_text"], batch["answer"], batch.get("trajectory") or [None] * n
                )
            ]
        else:
            every = [self.trl_call(batch, i, rows[i]) for i in range(n)]
        missing = [k for k in self.required if k not in every[0]] if every else []
        if missing:
            fields = ", ".join(k for k in rows[0] if k != "prompt") or "none"
            raise ConfigError(
                f"{self.where} requires {', '.join(missing)}, which the rows do not have (their other fields: "
                f"{fields}). TRL passes each row field but 'prompt' by name: rename the parameter or the field."
            )
        if self.keywords is None:  # **kwargs: every keyword
            return every
        return [{k: v for k, v in call.items() if k in self.keywords} for call in every]

    def trl_call(self, batch, i: int, row: dict) -> dict:
        """TRL's keywords for response ``i`` alone: lists of one. A prompt of chat messages makes the
        completion a list of one assistant message, as TRL's conversational format has it."""
        text = batch["response_text"][i]
        prompt = row.get("prompt")
        if prompt is None and "messages" in batch:  # rows without TRL's prompt field: the user message
            prompt = [m for m in batch["messages"][i] if m["role"] == "user"][-1]["content"]
        completion = [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text
        call = {k: [v] for k, v in row.items() if k not in ("prompt", "completion", "completion_ids")}
        call |= {"prompts": [prompt], "completions": [completion], "completion_ids": [self.token_ids(batch, i)]}
        return call | self.options.kwargs

    @staticmethod
    def token_ids(batch, i: int) -> list[int] | None:
        if "responses" not in batch:
            return None
        mask = batch.get("response_attention_mask")
        mask = batch["response_mask"] if mask is None else mask
        return batch["responses"][i][mask[i].bool()].tolist()

    def score(self, batch) -> list[float]:
        o, texts = self.options, batch["response_text"]
        outcomes = self.pool.map(self.calls(batch), o.timeout_s)
        scores, failures, not_applicable, extras = [], [], 0, {}
        for i, outcome in enumerate(outcomes):
            value = 0.0
            if outcome.error is None:
                try:
                    if o.style == "verl":
                        value, more = verl_score(outcome.value)
                        for k, v in more.items():
                            extras.setdefault(k, []).append(v)
                    else:
                        value = trl_score(outcome.value)
                        not_applicable += value is None
                        value = 0.0 if value is None else value  # TRL sums rewards with nansum: None adds 0
                except ValueError as e:
                    outcome.error, value = str(e), 0.0
            if outcome.error is not None:
                failures.append(f"response {i} ({texts[i][:100]!r}): {outcome.error}")
            scores.append(value)
        self.report(failures, len(texts))
        self._metrics = {"errors": len(failures) / max(len(texts), 1)}
        if o.style == "trl":
            self._metrics["not_applicable"] = not_applicable / max(len(texts), 1)
        clash = sorted(set(extras) & RESERVED)
        if clash:
            print(f"warning: {self.where}: extras {', '.join(clash)} are not logged (reserved).", file=sys.stderr)
        self._metrics |= {k: math.fsum(v) / len(v) for k, v in extras.items() if k not in RESERVED}
        return scores

    def report(self, failures: list[str], total: int) -> None:
        """Print the first failures; raise when more than max_error_rate of the responses failed."""
        if not failures:
            return
        rate = self.options.max_error_rate
        shown = "; ".join(failures[:SHOWN_FAILURES]) + (
            f"; and {len(failures) - SHOWN_FAILURES} more" if len(failures) > SHOWN_FAILURES else ""
        )
        if len(failures) > rate * total:
            raise RuntimeError(
                f"{self.where}: {len(failures)} of {total} responses failed, more than max_error_rate={rate:g}: {shown}"
            )
        print(
            f"warning: {self.where}: {len(failures)} of {total} responses failed and score 0: {shown}", file=sys.stderr
        )

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def close(self) -> None:
        self.pool.close()
