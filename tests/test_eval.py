"""Evaluation (data.eval, trainer.eval_every, hybridrl eval): pass@k as Chen et al. define it, metrics
logged at the step they were measured, samples saved, bad input refused before any model loads,
and training that goes exactly as it would without evaluation (also resumed, also with rollout.async)."""

import json
import math
import random

import pytest
import torch
from hybridrl_testing import SevensPlugin, metrics_rows, torchrun

from hybridrl.builtin.rollout_hf import HFEngine
from hybridrl.cli import main
from hybridrl.config import ConfigError, load_config
from hybridrl.evaluation import pass_at_k, summarize
from hybridrl.hookspecs import hookimpl
from hybridrl.run import build_run
from hybridrl.trainer import Trainer

HELD_OUT = {"name": "held", "source": "reasoning_gym", "task": "chain_sum", "size": 6, "seed": 1}
SAMPLED = {
    "name": "sampled",
    "source": "reasoning_gym",
    "task": "chain_sum",
    "size": 5,
    "seed": 2,
    "greedy": False,
    "n": 4,
    "temperature": 1.0,
    "pass_k": [1, 2, 4],
    "correct_at": 0.1,
    "rewards": [{"function": "sevens"}],
}


def config(model, run_dir, eval_sets=(), **trainer):
    return {
        "model": {"path": model},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 32, "eval": list(eval_sets)},
        "rollout": {"engine": "hf", "n": 4, "max_tokens": 6},
        "rewards": [{"function": "sevens"}],
        "algorithm": {"name": "grpo", "kl_coef": 0.01},
        "trainer": {"steps": 3, "prompts_per_step": 2, "lr": 1e-2, "seed": 0, "threads": 1, "run_dir": str(run_dir)}
        | trainer,
        "logging": {"loggers": ["jsonl"]},
    }


def training(run_dir) -> list[dict]:
    """The training rows of metrics.jsonl, without what measures time (or the sync check, which runs at a
    resume's first step)."""
    skip = ("timing/", "throughput/", "time", "async/", "rollout/sync_check")
    return [
        {k: v for k, v in r.items() if not k.startswith(skip)}
        for r in metrics_rows(run_dir)
        if not any(k.startswith("eval/") for k in r)
    ]


@pytest.fixture
def sevens(register_plugin):
    register_plugin(SevensPlugin(), name="sevens")


# -- pass@k --------------------------------------------------------------------------------------


def test_pass_at_k_is_the_unbiased_estimator_of_chen_et_al():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                want = 1 - math.comb(n - c, k) / math.comb(n, k)  # their eq. 1
                assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12), (n, c, k)
    assert pass_at_k(200, 3, 1) == pytest.approx(3 / 200)  # pass@1 is the fraction correct
    assert pass_at_k(200, 0, 100) == 0.0 and pass_at_k(200, 101, 100) == 1.0
    assert 0.0 < pass_at_k(10_000, 1, 5_000) < 1.0  # no binomial of 10,000 is ever formed
    for bad in [(4, 1, 5), (4, 1, 0), (4, 5, 1)]:
        with pytest.raises(ValueError, match="1 <= k <= n"):
            pass_at_k(*bad)


def test_summarize_counts_prompts_samples_lengths_and_truncation():
    samples = [
        {"index": p, "score": s, "correct": s >= 1.0, "length": 3 + p, "finish_reason": r}
        for p, (s, r) in enumerate([(1.0, "stop"), (0.0, "length")])
        for _ in range(2)
    ]
    samples[1]["score"], samples[1]["correct"] = None, False  # a NaN score: wrong, out of the mean
    got = summarize(samples, 2, [1, 2])
    assert got == {
        "score": pytest.approx(1 / 3),
        "mean@2": 0.25,
        "pass@1": 0.25,
        "pass@2": 0.5,
        "response_length/mean": 3.5,
        "response_length/clip_ratio": 0.5,
    }


# -- bad input: one error line each, before any model loads ---------------------------------------


def base(**eval_set):
    return {
        "model": {"path": "unused"},
        "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 8, "eval": [HELD_OUT | eval_set]},
        "rewards": [{"function": "reasoning_gym"}],
    }


@pytest.mark.parametrize(
    ("eval_set", "message"),
    [
        ({"greedy": False, "n": 4, "pass_k": [1, 8]}, r"data.eval\[0\] \(set 'held'\): pass_k has k=8 with n=4"),
        ({"n": 4}, r"n=4 with greedy decoding .* Set greedy: false"),
        ({"temperature": 0.7}, r"temperature set with greedy: true"),
        ({"name": "a/b"}, r"data.eval.0.name"),
        ({"bogus": 1}, r"Unknown key 'bogus' in data.eval\[0\] \(dataset 'reasoning_gym'\)"),
    ],
)
def test_contradicting_settings_are_one_error_naming_the_set(eval_set, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config(data=base(**eval_set))
    assert len(str(e.value).splitlines()) == 1


def test_two_sets_of_one_name_are_refused():
    data = base()
    data["data"]["eval"].append(HELD_OUT)
    with pytest.raises(ConfigError, match="two sets share a name"):
        load_config(data=data)


def no_model_loads(monkeypatch):
    import hybridrl.run

    monkeypatch.setattr(hybridrl.run, "load_causal_lm", lambda *a, **k: pytest.fail("a model was loaded"))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_set_that_yields_no_prompts_is_refused_before_any_model_loads(tiny_model, tmp_path, monkeypatch, sevens):
    no_model_loads(monkeypatch)
    empty = {"name": "empty", "source": "hf", "path": "json", "data_files": write_jsonl(tmp_path / "e.jsonl", [])}
    with pytest.raises(ConfigError, match=r"data.eval\[0\].*yields no prompts") as e:
        build_run(load_config(data=config(tiny_model, tmp_path / "run", [empty])))
    assert len(str(e.value).splitlines()) == 1


def test_a_reward_that_needs_an_answer_the_set_lacks_is_refused_before_any_model_loads(
    tiny_model, tmp_path, monkeypatch, sevens
):
    no_model_loads(monkeypatch)
    questions = write_jsonl(tmp_path / "q.jsonl", [{"question": "1 + 1 =", "data_source": "toy"}])
    eval_set = {"name": "toy", "source": "hf", "path": questions, "rewards": [{"function": "answer_match"}]}
    with pytest.raises(ConfigError) as e:
        build_run(load_config(data=config(tiny_model, tmp_path / "run", [eval_set])))
    message = str(e.value)
    assert len(message.splitlines()) == 1
    assert "data.eval[0] (set 'toy'): reward 'answer_match' (function 'answer_match') reads the rows' answer" in message
    assert "data.eval[0].answer_column" in message and "question, data_source" in message


# -- in the loop --------------------------------------------------------------------------------


class EvaluateAgain:
    """At the end of training (the engine still open): evaluate once more, with the random state around."""

    @hookimpl
    def on_train_end(self, run):
        self.before = torch.get_rng_state(), random.getstate()
        self.results = run.evaluation.evaluate(3)
        self.state = torch.get_rng_state(), random.getstate()


def test_eval_is_logged_at_its_steps_saves_its_samples_and_changes_no_training(
    tiny_model, tmp_path, sevens, register_plugin
):
    plain = tmp_path / "plain"
    Trainer(build_run(load_config(data=config(tiny_model, plain)))).train()
    run = tmp_path / "eval"
    again = register_plugin(EvaluateAgain(), name="again")
    Trainer(build_run(load_config(data=config(tiny_model, run, [HELD_OUT, SAMPLED], eval_every=2)))).train()

    assert training(run) == training(plain)  # bit for bit: no random state, seed or engine figure moved
    evals = [r for r in metrics_rows(run) if "eval/held/mean@1" in r]
    assert [r["step"] for r in evals] == [0, 2, 3]  # before training, every 2 steps, after the last
    for r in evals:
        assert set(r) >= {"eval/held/score", "eval/held/response_length/mean", "eval/held/response_length/clip_ratio"}
        assert 0 <= r["eval/sampled/pass@1"] <= r["eval/sampled/pass@2"] <= r["eval/sampled/pass@4"] <= 1
        assert r["eval/sampled/pass@1"] == pytest.approx(r["eval/sampled/mean@4"])
    for step in (0, 2, 3):
        held = [json.loads(line) for line in (run / "eval" / f"step-{step:06d}-held.jsonl").read_text().splitlines()]
        sampled = (run / "eval" / f"step-{step:06d}-sampled.jsonl").read_text().splitlines()
        assert len(held) == 6 and len(sampled) == 5 * 4
        assert [s["index"] for s in held] == list(range(6))
        assert {"prompt", "response", "score", "data_source", "answer", "correct"} <= set(held[0])
    # the same weights evaluated again, at the end of the run: the same samples (greedy, and seeded by
    # the set, not the step), and the random state as it was
    assert again.state[0].equal(again.before[0]) and again.state[1] == again.before[1]
    assert {k: v for r in again.results for k, v in r.logged().items()} == {
        k: v for k, v in evals[-1].items() if k.startswith("eval/")
    }


def test_a_resumed_run_with_eval_is_the_uninterrupted_one(tiny_model, tmp_path, sevens):
    straight = tmp_path / "straight"
    Trainer(build_run(load_config(data=config(tiny_model, straight, [HELD_OUT], steps=4, eval_every=3)))).train()
    resumed = tmp_path / "resumed"
    Trainer(build_run(load_config(data=config(tiny_model, resumed, [HELD_OUT], steps=2, eval_every=3)))).train()
    Trainer(
        build_run(load_config(data=config(tiny_model, resumed, [HELD_OUT], steps=4, eval_every=3, resume=True)))
    ).train()

    assert training(resumed) == training(straight)
    # the interrupted run evaluated after its last step (2) as well; the resumed one did not evaluate again
    at = lambda run: [r["step"] for r in metrics_rows(run) if "eval/held/score" in r]  # noqa: E731
    assert at(straight) == [0, 3, 4] and at(resumed) == [0, 2, 3, 4]
    same = lambda run: {r["step"]: r["eval/held/score"] for r in metrics_rows(run) if "eval/held/score" in r}  # noqa: E731
    assert {s: v for s, v in same(resumed).items() if s != 2} == same(straight)


class ApartHF(HFEngine):
    """The hf engine, said to run apart from training: rollout.async then prefetches with it."""

    def runs_apart(self):
        return True


class ApartPlugin:
    @hookimpl
    def register_rollout_engines(self, register):
        register("hf_apart", ApartHF)


def test_with_rollout_async_eval_changes_no_queued_batch(tiny_model, tmp_path, sevens, register_plugin):
    register_plugin(ApartPlugin(), name="hf-apart")
    runs = {}
    for name, sets in [("plain", []), ("eval", [HELD_OUT])]:
        cfg = config(tiny_model, tmp_path / name, sets, steps=4, eval_every=1)
        cfg["rollout"] |= {"engine": "hf_apart", "async": 1}
        trainer = Trainer(build_run(load_config(data=cfg)))
        trainer.train()
        assert trainer.prefetch is not None
        runs[name] = training(tmp_path / name)
    assert runs["eval"] == runs["plain"]
    assert [r["rollout/staleness_max"] for r in runs["eval"]] == [0.0, 1.0, 1.0, 1.0]
    assert [r["step"] for r in metrics_rows(tmp_path / "eval") if "eval/held/score" in r] == [0, 1, 2, 3, 4]


# -- hybridrl eval --------------------------------------------------------------------------------


def test_the_eval_command_reports_a_checkpoint_the_base_model_and_a_folder(tiny_model, tmp_path, capsys):
    toy = [{"question": f"{i} + 7 =", "answer": str(i + 7), "data_source": "ab"[i % 2]} for i in range(5)]
    mixed = {"name": "mixed", "source": "hf", "path": write_jsonl(tmp_path / "toy.jsonl", toy), "max_tokens": 3}
    cfg = config(tiny_model, tmp_path / "run", [HELD_OUT, mixed], steps=1)
    cfg["rewards"] = [{"function": "format", "pattern": "7"}]
    path = tmp_path / "cfg.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    Trainer(build_run(load_config(path))).train()
    trained = [r for r in metrics_rows(tmp_path / "run") if r["step"] == 1 and "eval/held/score" in r][0]

    def cli(*args):
        assert main(["eval", str(path), *args]) == 0
        return capsys.readouterr().out

    out = cli("--checkpoint", str(tmp_path / "run" / "checkpoints" / "step-000001"), "-o", str(tmp_path / "r.json"))
    assert "held" in out and "mean@1" in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["step"] == 1 and "step-000001" in report["model"] and report["date"]
    held = report["sets"]["held"]
    assert held["counts"] | {"nonfinite_scores": 0} == {
        "prompts": 6,
        "samples": 6,
        "correct": held["counts"]["correct"],
    } | {"nonfinite_scores": 0}
    assert held["settings"]["greedy"] is True and held["settings"]["top_k"] == 1
    # the checkpoint's policy answers as the engine did after the step it was saved at
    assert held["metrics"]["score"] == trained["eval/held/score"]
    assert held["metrics"]["response_length/mean"] == trained["eval/held/response_length/mean"]

    # verl's data_source column splits the set: eval/mixed/a/..., eval/mixed/b/...
    by_source = report["sets"]["mixed"]["by_source"]
    assert sorted(by_source) == ["a", "b"] and "mixed/a" in out
    assert report["sets"]["mixed"]["metrics"]["response_length/mean"] == pytest.approx(
        (3 * by_source["a"]["response_length/mean"] + 2 * by_source["b"]["response_length/mean"]) / 5
    )
    assert "eval/mixed/a/mean@1" in trained and report["sets"]["mixed"]["settings"]["max_tokens"] == 3

    cli("--model", tiny_model, "-o", str(tmp_path / "base.json"))
    before = [r for r in metrics_rows(tmp_path / "run") if r["step"] == 0][0]
    base_report = json.loads((tmp_path / "base.json").read_text())
    assert base_report["sets"]["held"]["metrics"]["score"] == before["eval/held/score"]


@pytest.mark.torchrun
def test_the_eval_command_splits_a_set_over_torchrun_ranks_and_gathers_it(tiny_model, tmp_path, capsys):
    cfg = config(tiny_model, tmp_path / "run", [HELD_OUT | {"size": 7}, SAMPLED | {"rewards": None}])
    cfg["rewards"] = [{"function": "format", "pattern": "7"}]
    path = tmp_path / "cfg.yaml"
    path.write_text(json.dumps(cfg))
    assert main(["eval", str(path), "-o", str(tmp_path / "one.json")]) == 0
    one = json.loads((tmp_path / "one.json").read_text())["sets"]

    proc = torchrun(["-m", "hybridrl.cli", "eval", str(path), "-o", str(tmp_path / "two.json")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("report:") == 1  # rank 0 speaks
    two = json.loads((tmp_path / "two.json").read_text())["sets"]
    # 7 prompts over 2 ranks (3 and 4), gathered in order: every prompt once, its samples together
    samples = [json.loads(line) for line in (tmp_path / "run" / "eval" / "step-000000-held.jsonl").open()]
    assert [s["index"] for s in samples] == list(range(7))
    assert two["held"]["counts"] == one["held"]["counts"] and two["sampled"]["counts"]["samples"] == 5 * 4
    # greedy: the same answers however the set is split (sampled sets draw other samples when split otherwise
    # with the hf engine, which seeds a call, not each prompt as vllm and sglang do)
    assert two["held"]["metrics"] == pytest.approx(one["held"]["metrics"])
