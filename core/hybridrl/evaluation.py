"""Evaluation: held-out prompt sets (``data.eval``) answered through the engine session, scored by
their rewards and summed up per set; a stage of the loop and the ``hybridrl eval`` command
(docs/evaluation.md).

What a set reports, as ``eval/<set>/<metric>`` (and ``eval/<set>/<value>/<metric>`` for each value
of its ``breakdown`` field, verl's ``data_source``, where the rows have one):

- ``score``: the mean score, the weighted sum of the set's rewards before any shaping (verl's
  ``val/test_score``);
- ``mean@<n>``: the fraction of the samples that are correct (score >= ``correct_at``), n per prompt;
- ``pass@<k>``: for each k of ``pass_k``, the mean over prompts of :func:`pass_at_k`;
- ``response_length/mean`` and ``response_length/clip_ratio``: tokens per response, and the
  fraction cut at max_tokens.

How it runs, and why it changes nothing of the training run around it:

- each set's rows are split over the ranks (:func:`hybridrl.distributed.my_range`), answered in calls
  of ``prompts_per_call`` prompts by :meth:`hybridrl.rollout.RolloutStage.respond` (the engine session;
  the agent loop where the run has one), scored on the rank, and gathered on every rank;
- sampling is seeded by the session's rule (:func:`hybridrl.session.rollout_seed`) with round
  ``EVAL_ROUND + set index`` of step 0: prompt p of a set is seeded ``base + p·n`` at every
  evaluation, far from the seeds of any step;
- the random state of python, numpy, torch and CUDA is saved before and restored after (the hf
  engine seeds torch's global generator);
- the engine is woken and left awake (the loop's next rollout sleeps it before the update; a sleep
  here would drop the weights of a vLLM engine at sleep_level 2 until the next sync), and its
  figures of these calls are read and dropped, so that the next step logs its own;
- the reward functions score the responses; the shaping statistics are neither used nor updated.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from hybridrl import checkpoint as ckpt
from hybridrl import distributed
from hybridrl.components import SamplingParams
from hybridrl.errors import ConfigError, stage_errors
from hybridrl.models import check_context
from hybridrl.prompts import check_columns, check_reward_fields, longest_prompt
from hybridrl.rewards import Rewards
from hybridrl.rollout import RolloutStage
from hybridrl.session import EVAL_ROUND, rollout_seed

EVAL_DIR = "eval"  # RUN_DIR/eval/step-NNNNNN-<set>.jsonl: every evaluated sample
CONTEXT_ROWS = 256  # rows whose prompt lengths are checked against the model's context (as for data)
#: the data section's keys that a set may set for itself (None: the data section's)
PROMPT_KEYS = ("prompt_column", "answer_column", "template", "system_prompt", "chat_template", "max_prompt_tokens")


def finite(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from ``n`` samples of which ``c`` are correct (Chen et al.
    2021, "Evaluating Large Language Models Trained on Code", eq. 1): 1 - C(n-c, k) / C(n, k), as
    the product 1 - prod_{i=n-c+1..n} (1 - k/i) of its numerically stable form (their figure 3),
    which never forms the binomials. 1 when fewer than k samples are wrong."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n (n={n}, c={c}, k={k}).")
    if n - c < k:
        return 1.0
    wrong = 1.0
    for i in range(n - c + 1, n + 1):
        wrong *= 1.0 - k / i
    return 1.0 - wrong


def summarize(samples: list[dict], n: int, pass_k: list[int]) -> dict[str, float]:
    """The metrics of samples (dicts with ``index`` (the prompt), ``score``, ``correct``, ``length``,
    ``finish_reason``): n per prompt. A NaN or infinite score counts as wrong and is left out of
    ``score``."""
    by_prompt: dict[int, list[bool]] = defaultdict(list)
    for s in samples:
        by_prompt[s["index"]].append(bool(s["correct"]))
    finite = [s["score"] for s in samples if s["score"] is not None and math.isfinite(s["score"])]
    out = {
        "score": sum(finite) / len(finite) if finite else float("nan"),
        f"mean@{n}": sum(s["correct"] for s in samples) / len(samples),
    }
    for k in pass_k:
        out[f"pass@{k}"] = sum(pass_at_k(len(c), sum(c), k) for c in by_prompt.values()) / len(by_prompt)
    out["response_length/mean"] = sum(s["length"] for s in samples) / len(samples)
    out["response_length/clip_ratio"] = sum(s["finish_reason"] == "length" for s in samples) / len(samples)
    return out


@dataclass
class SetResult:
    """One set's evaluation: its settings, every sample (on every rank), the metrics of the whole set
    and of each value of its breakdown field."""

    name: str
    settings: dict
    samples: list[dict]
    metrics: dict[str, float]
    by_source: dict[str, dict[str, float]]
    seconds: float

    @property
    def prompts(self) -> int:
        return len({s["index"] for s in self.samples})

    def logged(self) -> dict[str, float]:
        """The metrics as the loggers get them: ``eval/<set>/<metric>``, ``eval/<set>/<value>/<metric>``."""
        out = {f"eval/{self.name}/{k}": v for k, v in self.metrics.items()}
        for value, metrics in self.by_source.items():
            out |= {f"eval/{self.name}/{value}/{k}": v for k, v in metrics.items()}
        return out

    def report(self) -> dict:
        """The set in ``hybridrl eval``'s JSON report."""
        counts = {"prompts": self.prompts, "samples": len(self.samples)}
        counts["correct"] = sum(bool(s["correct"]) for s in self.samples)
        counts["nonfinite_scores"] = sum(s["score"] is None or not math.isfinite(s["score"]) for s in self.samples)
        return {
            "metrics": self.metrics,
            "by_source": self.by_source,
            "counts": counts,
            "settings": self.settings,
            "seconds": round(self.seconds, 3),
        }


@dataclass
class EvalSet:
    """A set of ``data.eval``, built: its prompt source and the data section its prompts are built by;
    once connected (:meth:`Evaluation.connect`), its rollout stage and rewards."""

    index: int
    config: Any  # hybridrl.config.EvalSetConfig
    source: Any  # the prompt source (PromptSource)
    data: Any  # the data section with the set's own prompt keys
    stage: RolloutStage | None = None
    rewards: Rewards | None = None
    own_rewards: bool = False

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def where(self) -> str:
        return f"data.eval[{self.index}] (set '{self.name}')"

    def sampling(self, rollout) -> dict:
        """What the engine samples with (``rollout``: the config's rollout section, for max_tokens and
        stop). Greedy decoding is top_k 1: the engines' contract takes temperatures above 0 only, and
        every engine (hf, vllm, sglang) keeps the most likely token alone under top_k 1."""
        c = self.config
        if c.greedy:
            keys = {"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 1}
        else:
            keys = {"n": c.n, "temperature": c.temperature, "top_p": c.top_p, "top_k": c.top_k}
        return keys | {"max_tokens": c.max_tokens or rollout.max_tokens, "stop": list(rollout.stop)}


class Evaluation:
    """The run's evaluation sets: built and checked before any model loads (the constructor),
    connected to the engine session and the rewards (:meth:`connect`), evaluated with the weights
    the engine holds (:meth:`evaluate`, :meth:`run`)."""

    def __init__(self, config, build, tokenizer, model_config):
        """``build(kind, name, options)`` builds a component as the trainer does; ``model_config``:
        the policy's transformers config (its context length)."""
        self.config, self.tokenizer = config, tokenizer
        self.sets = [self._load(i, s, build, model_config) for i, s in enumerate(config.data.eval)]
        self.session = None

    def _load(self, index: int, s, build, model_config) -> EvalSet:
        data = self.config.data.model_copy(update={"source": s.source})
        data = data.model_copy(update={k: getattr(s, k) for k in PROMPT_KEYS if getattr(s, k) is not None})
        key, where = f"data.eval[{index}]", f"data.eval[{index}] (set '{s.name}')"
        try:  # the prompt source's and the data section's checks, their keys turned into the set's
            es = EvalSet(index, s, build("dataset", s.source, s.options), data)
            check_columns(es.source, self.config.model_copy(update={"data": data}))
            longest = longest_prompt(es.source, data, self.tokenizer, CONTEXT_ROWS)
            check_context(model_config, longest, es.sampling(self.config.rollout)["max_tokens"])
        except ConfigError as e:
            text = str(e).replace("in the data section", f"in {key}").replace("data:", f"{where}:")
            # the set's max_tokens defaults to rollout.max_tokens
            raise ConfigError(
                text.replace("data.", f"{key}.").replace("rollout.max_tokens", f"{key}.max_tokens")
            ) from None
        rewards = s.rewards if s.rewards is not None else self.config.rewards
        check_reward_fields(es.source[0], data, rewards, where, key)
        return es

    def connect(self, session, rewards: Rewards, agent, build) -> None:
        """Answer through ``session`` (and the ``agent`` loop, if any); score with the run's ``rewards``
        or the set's own, built now with ``build``."""
        self.session = session
        for es in self.sets:
            es.stage = RolloutStage(
                session, es.source, None, self.tokenizer, self.config.model_copy(update={"data": es.data}), agent
            )
            own = es.config.rewards
            if own is None:
                es.rewards = rewards
            else:
                pairs = [(r, build("reward function", r.function, r.options)) for r in own]
                es.rewards, es.own_rewards = Rewards(pairs, rewards.policy_device), True

    def evaluate(self, step: int) -> list[SetResult]:
        """Every set, with the weights the engine holds (collective: every rank calls it). ``step``
        names the samples; the random state around it is left as it was."""
        state = ckpt.rng_state()
        try:
            results = [self._evaluate_set(es, step) for es in self.sets]
            self.session.metrics()  # the engine's figures of these calls: not the next step's
        finally:
            ckpt.set_rng_state(state)
        for r in results:
            bad = sum(s["score"] is None for s in r.samples)
            if bad and distributed.is_main():
                print(f"warning: evaluation set '{r.name}': {bad} NaN/Inf scores, counted as wrong", file=sys.stderr)
        return results

    def run(self, step: int, run_dir: Path) -> dict[str, float]:
        """The loop's evaluation after ``step`` (0: before training): the metrics to log, the samples
        written to ``run_dir/eval/`` by rank 0."""
        if not self.sets:
            return {}
        results = self.evaluate(step)
        if distributed.is_main():
            for r in results:
                save_samples(r, Path(run_dir) / EVAL_DIR, step)
        metrics = {k: v for r in results for k, v in r.logged().items()}
        return metrics | {"timing/eval": sum(r.seconds for r in results)}

    def _evaluate_set(self, es: EvalSet, step: int) -> SetResult:
        start = time.perf_counter()
        keys, c = es.sampling(self.config.rollout), es.config
        n = keys["n"]
        t, world = self.config.trainer, distributed.world_size()
        per_call = c.prompts_per_call or max(1, t.prompts_per_step // world * self.config.rollout.n // n)
        mine, samples = distributed.my_range(len(es.source)), []
        for first in range(mine.start, mine.stop, per_call):
            rows = [es.source[i] for i in range(first, min(first + per_call, mine.stop))]
            seed = rollout_seed(self.session.seed, 0, EVAL_ROUND + es.index, first, n)
            batch = es.stage.respond(rows, SamplingParams(**keys, seed=seed))
            samples += self._samples(es, batch, rows, first, n)
        samples = distributed.gather_lists(samples)
        by_source = defaultdict(list)
        for s in samples:
            if s.get("data_source") is not None:
                by_source[str(s["data_source"])].append(s)
        settings = {"source": c.source, "rows": len(es.source), **keys, "greedy": c.greedy, "pass_k": c.pass_k}
        settings |= {
            "correct_at": c.correct_at,
            "rewards": [f"{rc.label} x {rc.weight:g}" for rc, _ in es.rewards.pairs],
        }
        return SetResult(
            es.name,
            settings,
            samples,
            summarize(samples, n, c.pass_k),
            {v: summarize(group, n, c.pass_k) for v, group in sorted(by_source.items())},
            time.perf_counter() - start,
        )

    def _samples(self, es: EvalSet, batch, rows: list[dict], first: int, n: int) -> list[dict]:
        """Score ``batch`` (the responses to ``rows``, the set's prompts from index ``first``) with the
        set's rewards, unshaped: one record per response."""
        total, each = torch.zeros(len(batch)), {}
        for i, (rc, fn) in enumerate(es.rewards.pairs):
            component = f"reward '{rc.label}' (function '{rc.function}')"
            with (
                stage_errors(component, f"score (evaluation set '{es.name}')"),
                es.rewards.device_errors(component, i, fn),
            ):
                scores = torch.as_tensor(fn.score(batch), dtype=torch.float32).reshape(-1)
            if scores.shape[0] != len(batch):
                raise RuntimeError(f"reward '{rc.label}' returned {scores.shape[0]} scores for {len(batch)} responses.")
            each[rc.label] = scores
            total += rc.weight * scores
        lengths = batch["response_mask"].sum(-1).tolist()
        column, out = es.config.breakdown, []
        for i in range(len(batch)):
            score = float(total[i])
            out.append(
                {
                    "index": first + i // n,
                    "sample": i % n,
                    "prompt": batch["prompt_text"][i],
                    "response": batch["response_text"][i],
                    "answer": batch["answer"][i],
                    "score": finite(score),
                    "correct": math.isfinite(score) and score >= es.config.correct_at,
                    "length": int(lengths[i]),
                    "finish_reason": batch["finish_reason"][i],
                    "data_source": rows[i // n].get(column) if column else None,
                    **{f"reward/{label}": finite(s[i]) for label, s in each.items()},
                }
            )
        return out

    def close(self) -> None:
        """Release the rewards the sets built for themselves."""
        for es in self.sets:
            if es.own_rewards:
                es.rewards.close()


def save_samples(result: SetResult, folder: Path, step: int) -> Path:
    """``folder/step-NNNNNN-<set>.jsonl``: one JSON object per sample (prompt, response, score, ...), the
    owner's alone."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = folder / f"step-{step:06d}-{result.name}.jsonl"
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8") as f:
        for s in result.samples:
            f.write(json.dumps({"step": step, **s}, ensure_ascii=False, default=str) + "\n")
    return path


# -- the command: hybridrl eval CONFIG [--checkpoint DIR | --model DIR] ------------------------


def model_to_evaluate(cfg, checkpoint: str | None, model: str | None) -> tuple[str, int]:
    """Point ``cfg.model`` at what ``hybridrl eval`` evaluates: a checkpoint's policy folder, a model
    folder (an exported checkpoint), or model.path; returns its description and step (0 but for a
    checkpoint). A checkpoint's policy files are first checked against its meta.json as a resume checks
    them (:func:`hybridrl.checkpoint_files.verify`): a file changed, added or missing, or a link, is refused."""
    if checkpoint:
        policy = Path(checkpoint) / "policy"
        if (policy / "adapter_config.json").is_file():
            raise ConfigError(
                f"--checkpoint {checkpoint} holds LoRA adapters, not a whole model. Merge them first: hybridrl "
                f"export {checkpoint} OUT --merged, then hybridrl eval CONFIG --model OUT."
            )
        if not (policy / "config.json").is_file():
            raise ConfigError(
                f"--checkpoint {checkpoint} holds no policy/config.json: give a RUN_DIR/checkpoints/step-N folder."
            )
        ckpt.verify(Path(checkpoint).resolve(), under="policy/")
        try:
            step = ckpt.step_of(Path(checkpoint).resolve())
        except ValueError:
            step = 0
        cfg.model.path, cfg.model.gguf_file = str(policy.resolve()), None
        return f"checkpoint {checkpoint}", step
    if model:
        cfg.model.path, cfg.model.gguf_file = model, None
        return f"model {model}", 0
    gguf = f" ({cfg.model.gguf_file})" if cfg.model.gguf_file else ""
    return f"model.path {cfg.model.path}{gguf}", 0


def report(results: list[SetResult], model: str, step: int) -> dict:
    """``hybridrl eval``'s JSON report: per set its metrics, counts and settings; the model and date."""
    from hybridrl import __version__

    return {
        "model": model,
        "step": step,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hybridrl": __version__,
        "sets": {r.name: r.report() for r in results},
    }


def table(results: list[SetResult]) -> str:
    """A plain-text table: one line per set (and per value of its breakdown), one column per metric."""
    rows = []
    for r in results:
        rows.append((r.name, r.prompts, r.metrics))
        rows += [(f"  {r.name}/{v}", None, m) for v, m in r.by_source.items()]
    columns = list(dict.fromkeys(k for _, _, m in rows for k in m))
    head = ["set", "prompts", *columns]
    body = [
        [name, "" if p is None else str(p), *(f"{m[c]:.4f}" if c in m else "" for c in columns)] for name, p, m in rows
    ]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = [
        "  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(line, widths)))
        for line in [head, *body]
    ]
    return "\n".join(lines)


def write_report(path: Path, data: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return path
