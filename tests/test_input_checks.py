"""Bad input is one error line before any model loads: non-finite numbers, lengths beyond the
model's context, empty or prompt-less data; the resume command the program prints works as printed;
a run's files are its owner's alone."""

import json
import stat
import subprocess
import sys

import pytest

from hybridrl.config import ConfigError, load_config
from hybridrl.run import build_run

BASE = {
    "model": {"path": "unused"},
    "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 10},
    "rewards": [{"function": "reasoning_gym"}],
}


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"trainer": {"lr": float("inf")}}, "trainer.lr"),
        ({"trainer": {"lr": float("nan")}}, "trainer.lr"),
        ({"rewards": [{"function": "reasoning_gym", "weight": float("nan")}]}, "rewards.0.weight"),
        ({"rollout": {"temperature": float("inf")}}, "rollout.temperature"),
        ({"algorithm": {"name": "grpo", "kl_coef": float("nan")}}, "kl_coef"),
    ],
)
def test_non_finite_numbers_are_refused_naming_the_key(extra, key):
    with pytest.raises(ConfigError, match=rf"{key}.*finite number") as e:
        load_config(data={**BASE, **extra})
    assert "\n" not in str(e.value).strip() or key in str(e.value).splitlines()[0]


def run_for(tiny_model, tmp_path, data=None, **rollout):
    cfg = {
        **BASE,
        "model": {"path": tiny_model},
        "data": data or BASE["data"],
        "rollout": {"engine": "hf", "n": 2, **rollout},
        "trainer": {"steps": 1, "prompts_per_step": 2, "run_dir": str(tmp_path / "run")},
        "logging": {"loggers": ["jsonl"]},
    }
    return build_run(load_config(data=cfg))


def test_max_tokens_beyond_the_models_context_is_refused_before_it_loads(tiny_model, tmp_path, monkeypatch):
    import hybridrl.run

    monkeypatch.setattr(hybridrl.run, "load_causal_lm", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(ConfigError, match=r"rollout.max_tokens=1000000000 .* context of 256 tokens .* at most \d+"):
        run_for(tiny_model, tmp_path, max_tokens=10**9)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_an_empty_dataset_is_one_error(tiny_model, tmp_path):
    data = {"source": "hf", "path": "json", "data_files": write_jsonl(tmp_path / "empty.jsonl", [])}
    with pytest.raises(ConfigError, match="yields no prompts"):
        run_for(tiny_model, tmp_path, data=data)


@pytest.mark.parametrize("value", [None, ""])
def test_a_row_without_a_prompt_is_refused_not_trained_on_as_text(value, tiny_model, tmp_path):
    rows = [{"prompt": "2 + 2 =", "answer": "4"}, {"prompt": value, "answer": "5"}]
    data = {"source": "hf", "path": "json", "data_files": write_jsonl(tmp_path / "d.jsonl", rows)}
    data |= {"prompt_column": "prompt", "answer_column": "answer"}
    with pytest.raises(ConfigError, match=rf"a row's prompt \(field 'prompt'\) is {value!r}"):
        run_for(tiny_model, tmp_path, data=data)


def one_error(capsys, command: str, config: dict, tmp_path) -> str:
    """``hybridrl COMMAND`` on ``config``: one ``error:`` line on stderr (beside datasets' progress bars)."""
    import yaml

    from hybridrl import cli

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    assert cli.main([command, str(path)]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "examples/s" not in line]  # datasets' progress
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0].removeprefix("error: ")


def test_columns_the_prompts_and_rewards_read_are_checked_before_any_model_loads(
    tiny_model, tmp_path, monkeypatch, capsys
):
    """The training rows and every eval set's, against what the prompts (prompt column, template) and each
    reward (RewardFunction.needs) read: one error line from hybridrl validate, train and eval, no model loaded."""
    import hybridrl.run

    monkeypatch.setattr(hybridrl.run, "load_causal_lm", lambda *a, **k: pytest.fail("a model was loaded"))
    rows = write_jsonl(tmp_path / "q.jsonl", [{"question": "1 + 1 =", "data_source": "toy"}])
    config = {
        "model": {"path": tiny_model},
        "data": {"source": "hf", "path": rows},
        "rewards": [{"function": "answer_match"}],
        "rollout": {"n": 2, "max_tokens": 8},
        "trainer": {"device": "cpu", "steps": 1, "prompts_per_step": 2, "run_dir": str(tmp_path / "run")},
        "logging": {"loggers": ["jsonl"]},
    }
    for command in ("validate", "train"):
        assert one_error(capsys, command, config, tmp_path) == (
            "data: reward 'answer_match' (function 'answer_match') reads the rows' answer, which the rows do not "
            "have (fields: question, data_source). Either set data.answer_column to the field with the ground truth, "
            "or use rewards that do not read it."
        )
    format_reward = [{"function": "format", "pattern": "[0-9]"}]
    bad_column = {**config, "rewards": format_reward, "data": {**config["data"], "prompt_column": "prompt"}}
    assert one_error(capsys, "validate", bad_column, tmp_path).startswith(
        "data.prompt_column is 'prompt', but the rows have no such field. Fields: question, data_source."
    )
    bad_template = {**config, "rewards": format_reward, "data": {**config["data"], "template": "{problem}"}}
    assert one_error(capsys, "validate", bad_template, tmp_path).startswith("data.template uses {problem}")
    eval_set = {"name": "toy", "source": "hf", "path": rows, "rewards": [{"function": "answer_match"}]}
    with_eval = {**config, "rewards": format_reward, "data": {**config["data"], "eval": [eval_set]}}
    for command in ("validate", "eval"):
        assert one_error(capsys, command, with_eval, tmp_path).startswith(
            "data.eval[0] (set 'toy'): reward 'answer_match' (function 'answer_match') reads the rows' answer"
        )


def test_a_prompt_column_named_prompt_does_not_collide_with_the_template(tiny_model, tmp_path):
    from hybridrl.prompts import prompt_messages

    cfg = load_config(data={**BASE, "data": {**BASE["data"], "prompt_column": "prompt", "template": "Q: {prompt}"}})
    assert prompt_messages({"prompt": "2 + 2 =", "answer": "4"}, cfg.data)[-1]["content"] == "Q: 2 + 2 ="


def test_the_printed_resume_command_parses_as_printed():
    """hybridrl train CONFIG --resume trainer.run_dir=DIR: the overrides after the option."""
    from hybridrl import cli

    seen = {}
    cli.cmd_train, real = (lambda args: seen.update(vars(args)) or 0), cli.cmd_train
    try:
        assert cli.main(["train", "cfg.yaml", "--resume", "trainer.run_dir=runs/x", "trainer.steps=3"]) == 0
    finally:
        cli.cmd_train = real
    assert seen["resume"] and seen["overrides"] == ["trainer.run_dir=runs/x", "trainer.steps=3"]
    proc = subprocess.run(
        [sys.executable, "-m", "hybridrl.cli", "train", "cfg.yaml", "--resume", "--no-such-flag"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "unrecognized arguments: --no-such-flag" in proc.stderr


def test_a_runs_folder_and_config_are_the_owners_alone(tiny_model, tmp_path, monkeypatch):
    import hybridrl.run

    class Loaded(Exception):
        pass

    def stop(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(hybridrl.run, "load_causal_lm", stop)  # stop once the run's files are written
    with pytest.raises(Loaded):
        run_for(tiny_model, tmp_path)
    run = tmp_path / "run"
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    assert stat.S_IMODE((run / "config.yaml").stat().st_mode) == 0o600
