"""Secrets stay out of what a run writes: declared secrets are Secret types, free-form options are
scrubbed of known secret shapes, ``${env:VAR}`` values are written as the reference (config.yaml,
samples, metric names), and the run's folder and logs are their owner's alone from the start."""

import json
import stat
from pathlib import Path

import pytest
import torch
import yaml

from hybridrl import plugins
from hybridrl.builtin.loggers import JSONLLogger, clean_metrics, clean_value
from hybridrl.components import RunContext
from hybridrl.config import ConfigError, load_config
from hybridrl.config_files import dump_config, is_secret, redact
from hybridrl.options import Secret

BASE = {
    "model": {"path": "m"},
    "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 8},
    "rewards": [{"function": "format", "pattern": "7"}],
}


def context(run_dir: Path) -> RunContext:
    return RunContext(
        model_path="", tokenizer=None, device=torch.device("cpu"), dtype=torch.float32, seed=0, run_dir=run_dir
    )


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_declared_secrets_are_secret_types_that_no_dump_shows(monkeypatch):
    monkeypatch.setenv("MY_REWARD_TOKEN", "rt-from-the-environment-42")
    cfg = load_config(
        data=BASE
        | {
            "rollout": {"engine": "vllm", "base_url": "http://127.0.0.1:9", "api_key": "sk-plain-vllm-key-1"},
            "rewards": [{"function": "remote", "url": "http://127.0.0.1:9", "token": "${env:MY_REWARD_TOKEN}"}],
        }
    )
    key, token = cfg.rollout.options.api_key, cfg.rewards[0].options.token
    assert isinstance(key, Secret) and isinstance(token, Secret)
    assert key.get_secret_value() == "sk-plain-vllm-key-1" and token.get_secret_value() == "rt-from-the-environment-42"
    shown = f"{cfg.rollout.options!r} {key} {cfg.rollout.options.model_dump()} {cfg.rollout.options.model_dump_json()}"
    assert "sk-plain" not in shown and "<redacted>" in shown
    assert "sk-plain" not in repr(cfg) and "rt-from" not in repr(cfg)  # the sections' own copies too
    text = dump_config(cfg)
    assert "sk-plain" not in text and "rt-from" not in text
    dumped = yaml.safe_load(text)
    assert dumped["rollout"]["api_key"] == "<redacted>" and dumped["rewards"][0]["token"] == "${env:MY_REWARD_TOKEN}"
    with pytest.raises(ConfigError) as e:  # a bad value under a secret key is not echoed in the error
        load_config(data=BASE | {"rollout": {"engine": "vllm", "base_url": "http://x", "api_key": ["sk-in-a-list"]}})
    assert "sk-in-a-list" not in str(e.value) and "rollout.api_key" in str(e.value)


def test_every_option_named_as_a_secret_is_a_secret_type():
    """The installed plugins' options whose names say secret (api_key, token...) hold a Secret: no
    dump, repr or log of the options shows them, whatever their key is called in a file."""
    models = {
        f"{kind} '{name}'": getattr(e.cls, "Options", None)
        for kind, es in plugins.registry().items()
        for name, e in es.items()
    }
    models |= {f"section '{name}'": e.cls for name, e in plugins.config_sections().items()}
    named = []
    for who, model in models.items():
        for field, info in model.model_fields.items() if model is not None else ():
            if is_secret(field):
                named.append(field)
                assert "Secret" in str(info.annotation), f"{who}: option {field} is {info.annotation}"
    assert {"api_key", "token"} <= set(named)


def test_free_form_options_are_scrubbed_of_secret_shapes():
    kwargs = {
        "headers": {"Authorization": "Basic dXNlcjpodW50ZXIy", "X-Api-Key": "xk-0123456789", "Accept": "text/plain"},
        "api_keys": ["ak-1111111111", "ak-2222222222"],
        "hf_tokens": {"main": "hf_3333333333"},
        "bearer": "br-4444444444",
        "client_password": "pw-5555555555",
        "note": "send it with Bearer eyJ6666666666.abc",
        "endpoint": "https://alice:pw-7777777777@example.com/v1?api_key=qk-8888888888&lang=en",
        "mirror": "https://tk-9999999999@example.org/repo.git",
        "max_tokens": 64,
        "special_tokens": ["<tool>"],
        "keys": ["a", "b"],
        "plain": "https://example.com/v1?lang=en",
    }
    reward = {"function": "python", "path": "reward.py", "kwargs": kwargs}
    cfg = load_config(data=BASE | {"rewards": [reward]})
    text = dump_config(cfg)
    for secret in ["dXNlcjpodW50ZXIy", "0123456789", "alice"] + [str(d) * 10 for d in range(1, 10)]:
        assert secret not in text, secret
    out = yaml.safe_load(text)["rewards"][0]["kwargs"]
    assert out["headers"] == {"Authorization": "<redacted>", "X-Api-Key": "<redacted>", "Accept": "text/plain"}
    assert out["api_keys"] == ["<redacted>"] * 2 and out["hf_tokens"] == {"main": "<redacted>"}
    assert out["note"] == "send it with Bearer <redacted>"
    assert out["endpoint"] == "https://<redacted>@example.com/v1?api_key=<redacted>&lang=en"
    assert out["mirror"] == "https://<redacted>@example.org/repo.git"
    assert {k: out[k] for k in ("max_tokens", "special_tokens", "keys", "plain")} == {
        k: kwargs[k] for k in ("max_tokens", "special_tokens", "keys", "plain")
    }
    assert cfg.rewards[0].options.kwargs == kwargs  # the run itself has them
    again = yaml.safe_load(text)  # a scrubbed config.yaml, run again, asks for the secret
    with pytest.raises(ConfigError, match=r"rewards\.0\.kwargs\.headers\.Authorization is '<redacted>'"):
        load_config(data=again)
    again["rewards"][0]["kwargs"] = {"endpoint": out["endpoint"]}
    with pytest.raises(ConfigError, match=r"rewards\.0\.kwargs\.endpoint is 'https://<redacted>@.*'\$\{env:VAR\}'"):
        load_config(data=again)
    # the dashboard shows a config.yaml written before: the same scrubbing
    assert redact({"engine_kwargs": kwargs}) == {"engine_kwargs": out}


def test_env_values_are_written_as_the_reference_in_config_samples_and_metric_names(tmp_path, monkeypatch):
    monkeypatch.setenv("SECRET_PROMPT", "the-passphrase-is-swordfish")
    monkeypatch.setenv("SECRET_SET", "project-nightjar")
    monkeypatch.setenv("STEPS", "7")  # too short to seek in text: written back at its own key only
    data = BASE | {
        "data": BASE["data"] | {"system_prompt": "Remember: ${env:SECRET_PROMPT}."},
        "rewards": [{"function": "format", "pattern": "7", "name": "${env:SECRET_SET}"}],
        "trainer": {"steps": "${env:STEPS}"},
    }
    cfg = load_config(data=data)
    assert cfg.data.system_prompt == "Remember: the-passphrase-is-swordfish." and cfg.trainer.steps == 7
    text = dump_config(cfg)
    assert "swordfish" not in text and "nightjar" not in text
    dumped = yaml.safe_load(text)
    assert (
        dumped["data"]["system_prompt"] == "Remember: ${env:SECRET_PROMPT}."
        and dumped["trainer"]["steps"] == "${env:STEPS}"
    )
    logger = JSONLLogger(JSONLLogger.Options(), context(tmp_path))
    logger.open(total_steps=7, start_step=0)
    logger.log(1, {"reward/project-nightjar/mean": 0.5, "step_time": 7})
    row = {
        "prompt": "Remember: the-passphrase-is-swordfish. 7 + 7?",
        "response": "14",
        "extra": {"project-nightjar": 1},
    }
    logger.log_samples(1, [row])
    logger.close()
    written = (tmp_path / "metrics.jsonl").read_text() + (tmp_path / "samples.jsonl").read_text()
    assert "swordfish" not in written and "nightjar" not in written
    metrics = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert metrics["reward/${env:SECRET_SET}/mean"] == 0.5 and metrics["step_time"] == 7  # "7" itself stays
    sample = json.loads((tmp_path / "samples.jsonl").read_text())
    assert sample["prompt"] == "Remember: ${env:SECRET_PROMPT}. 7 + 7?" and sample["extra"] == {"${env:SECRET_SET}": 1}
    # the trackers clean their rows with the same functions
    assert clean_metrics({"eval/project-nightjar/mean@1": 1}) == {"eval/${env:SECRET_SET}/mean@1": 1.0}
    assert clean_value(["project-nightjar"]) == ["${env:SECRET_SET}"]


def test_logs_are_the_owners_alone_from_the_first_row(tmp_path):
    logger = JSONLLogger(JSONLLogger.Options(), context(tmp_path))
    logger.open(total_steps=2, start_step=0)
    logger.log(1, {"x": 1.0})
    assert mode(tmp_path / "metrics.jsonl") == 0o600 and mode(tmp_path / "samples.jsonl") == 0o600
    logger.close()
    for name in ("metrics.jsonl", "samples.jsonl"):  # files of an earlier version, then a resume
        (tmp_path / name).chmod(0o644)
    logger.open(total_steps=2, start_step=1)
    assert mode(tmp_path / "metrics.jsonl") == 0o600 and mode(tmp_path / "samples.jsonl") == 0o600
    logger.close()


def test_a_run_folder_made_beforehand_becomes_the_owners_alone(tiny_model, tmp_path, monkeypatch):
    import hybridrl.run

    class Loaded(Exception):
        pass

    def stop(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(hybridrl.run, "load_causal_lm", stop)  # stop once the run's files are written
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    run.chmod(0o755)
    cfg = BASE | {
        "model": {"path": tiny_model},
        "rollout": {"engine": "hf", "n": 2},
        "trainer": {"steps": 1, "prompts_per_step": 2, "run_dir": str(run)},
        "logging": {"loggers": ["jsonl"]},
    }
    with pytest.raises(Loaded):
        hybridrl.run.build_run(load_config(data=cfg))
    assert mode(run) == 0o700 and mode(run / "config.yaml") == 0o600
