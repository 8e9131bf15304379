"""The trackers plugin: wandb's offline run directory and TensorBoard's event files, read back.

One short real run (tiny random Llama, 2 steps, GRPO) writes through jsonl, wandb (offline, no
account) and tensorboard at once; the tests compare each tracker's files with metrics.jsonl. Without
the plugin, ``loggers: [wandb]`` is the usual unknown-logger error that lists what is installed.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import pytest
import torch

from hybridrl import plugins
from hybridrl.components import RunContext
from hybridrl.config import ConfigError, load_config

STEPS, PROMPTS, N = 2, 2, 4
REWARDS = [{"function": "format", "pattern": "7"}, {"function": "answer_match", "weight": 0.5}]
EXTRA = "pip install -e 'plugins/trackers[wandb,tensorboard]'"


def need(module: str, install: str = EXTRA):
    """Import a tracker library; skip when it is absent, except in CI where it must be installed."""
    try:
        return __import__(module)
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{module} is not installed in CI; install it with: {install}")
        pytest.skip(f"{module} is not installed ({install})")


def ctx(run_dir: Path) -> RunContext:
    return RunContext(
        model_path="", tokenizer=None, device=torch.device("cpu"), dtype=torch.float32, seed=0, run_dir=run_dir
    )


def strict_json(line: str):
    def reject(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(line, parse_constant=reject)


def base_config(tiny_model) -> dict:
    return {
        "model": {"path": tiny_model},
        "data": {"source": "reasoning_gym", "task": "chain_sum"},
        "rewards": [{"function": "format", "pattern": "7"}],
    }


@pytest.fixture(scope="module")
def real_run(tiny_model, tmp_path_factory):
    """A 2-step GRPO run logging to jsonl, wandb (offline: no API key anywhere) and tensorboard."""
    need("wandb")
    need("tensorboard")
    from hybridrl.run import build_run
    from hybridrl.trainer import Trainer

    tmp = tmp_path_factory.mktemp("trackers")
    run_dir = tmp / "run"
    with pytest.MonkeyPatch.context() as mp:
        for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
            mp.delenv(var, raising=False)
        mp.setenv("NETRC", str(tmp / "no-netrc"))  # no `wandb login` credentials either
        for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
            mp.setenv(var, str(tmp / var.lower()))
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("WANDB_CONSOLE", "off")
        cfg = load_config(
            data={
                "model": {"path": tiny_model},
                "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 16},
                "rollout": {"engine": "hf", "n": N, "max_tokens": 8},
                "rewards": REWARDS,
                "algorithm": {"name": "grpo", "kl_coef": 0.001},
                "trainer": {
                    "steps": STEPS,
                    "prompts_per_step": PROMPTS,
                    "lr": 1e-2,
                    "run_dir": str(run_dir),
                    "sample_every": 1,
                },
                "logging": {
                    "loggers": ["jsonl", "wandb", "tensorboard"],
                    "wandb": {"project": "hybridrl-test", "tags": ["ci", "tiny"]},
                },
            }
        )
        Trainer(build_run(cfg, name="trackers")).train()
    metrics = [strict_json(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = [strict_json(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    return run_dir, metrics, samples


# --- the plugin ----------------------------------------------------------------------------


def test_the_loggers_come_from_the_plugin_through_its_entry_point():
    info = {i.name: i for i in plugins.plugin_infos()}["trackers"]
    assert info.package == "hybridrl-trackers"
    assert info.registered == {"logger": ["wandb", "tensorboard"]}
    assert {"wandb", "tensorboard"} <= set(plugins.registry()["logger"])


def test_without_the_plugin_wandb_is_an_unknown_logger_listing_the_choices(tiny_model, monkeypatch):
    monkeypatch.setenv("HYBRIDRL_LOAD_PLUGINS", "grpo")  # entry-point plugins but grpo stay out
    plugins.reset()
    unknown = (
        r"Unknown logger 'wandb' \(logging\.loggers\)\. Available: console, jsonl\. "
        r"'wandb' comes with hybridrl-trackers: pip install -e plugins/trackers\."
    )
    try:
        with pytest.raises(ConfigError, match=unknown):
            load_config(data={**base_config(tiny_model), "logging": {"loggers": ["console", "wandb"]}})
    finally:
        monkeypatch.delenv("HYBRIDRL_LOAD_PLUGINS")
        plugins.reset()


def test_tracker_options_are_checked(tiny_model):
    base = base_config(tiny_model)
    with pytest.raises(ConfigError, match=r"Unknown key 'projct' in logging.wandb .*Valid keys: dir, entity"):
        load_config(data={**base, "logging": {"loggers": ["wandb"], "wandb": {"projct": "x"}}})
    with pytest.raises(ConfigError, match=r"logging.wandb.mode"):
        load_config(data={**base, "logging": {"loggers": ["wandb"], "wandb": {"mode": "cloud"}}})
    with pytest.raises(ConfigError, match=r"Unknown logger 'tensorbord'.*tensorboard"):
        load_config(data={**base, "logging": {"loggers": ["tensorbord"]}})


def test_missing_tracker_packages_name_the_package(tmp_path, monkeypatch):
    from hybridrl_trackers import TensorBoardLogger, WandbLogger

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ImportError, match=r"logger 'wandb'.*pip install wandb .*plugins/trackers\[wandb\]"):
        WandbLogger(WandbLogger.Options(), ctx(tmp_path))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(ImportError, match=r"logger 'tensorboard'.*pip install tensorboard .*\[tensorboard\]"):
        TensorBoardLogger(TensorBoardLogger.Options(), ctx(tmp_path))


# --- wandb ---------------------------------------------------------------------------------


def wandb_records(path: Path):
    """Records of a ``.wandb`` transaction log: wandb's LevelDB-style log of protobuf ``Record``s.

    Contract test of wandb's documented on-disk format (header ``:W&B``, magic 0xBEE1, version 0;
    then 32 KiB blocks of chunks with a 7-byte header: crc32c, length, type full/first/middle/last).
    """
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), data[:7]
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the block's tail is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending + payload)
            pending = b""
            yield record
        elif kind in (2, 3):
            pending += payload


def test_wandb_offline_run_directory_holds_the_run(real_run):
    run_dir, metrics, samples = real_run
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((run_dir / "wandb").iterdir())
    wrun = runs[0]
    run_id = (run_dir / "wandb-run-id").read_text()
    assert wrun.name.endswith(f"-{run_id}")
    log_file = wrun / f"run-{run_id}.wandb"
    assert log_file.stat().st_size > 0 and (wrun / "files").is_dir() and (wrun / "logs" / "debug.log").is_file()

    history, run_records, configs = {}, [], []
    for record in wandb_records(log_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(items["_step"], {}).update(items)
        elif kind == "run":  # the run record carries the initial config
            run_records.append(record.run)
            configs += [(item.key, json.loads(item.value_json)) for item in record.run.config.update]
        elif kind == "config":
            configs += [(item.key, json.loads(item.value_json)) for item in record.config.update]
    assert sorted(history) == [1, 2]
    for row in metrics:
        logged = history[row["step"]]
        assert logged["reward/mean"] == pytest.approx(row["reward/mean"])
        assert logged["actor/kl"] == pytest.approx(row["actor/kl"])
    run = run_records[0]
    assert (run.project, run.display_name, list(run.tags)) == ("hybridrl-test", "run", ["ci", "tiny"])
    config = dict(configs)
    assert config["trainer"]["steps"] == STEPS and config["rollout"]["n"] == N

    # the samples table of each step, as wandb writes a Table: columns + rows, in files/media/table
    tables = sorted((wrun / "files" / "media" / "table").glob("samples_*.table.json"))
    assert len(tables) == STEPS
    last = json.loads(next(t for t in tables if t.name.startswith("samples_2_")).read_text())
    cols = last["columns"]
    assert cols[:4] == ["step", "prompt", "response", "answer"] and "advantage" in cols and "reward/format" in cols
    step2 = [s for s in samples if s["step"] == 2]
    assert len(last["data"]) == len(step2)
    assert [row[cols.index("response")] for row in last["data"]] == [s["response"] for s in step2]
    assert (history[2]["samples._type"], history[2]["samples.nrows"]) == ("table-file", PROMPTS * N)


def test_wandb_mode_is_offline_without_an_api_key(tmp_path, monkeypatch):
    need("wandb")
    from hybridrl_trackers import WandbLogger

    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    netrc = tmp_path / "netrc"
    monkeypatch.setenv("NETRC", str(netrc))
    logger = lambda **o: WandbLogger(WandbLogger.Options(**o), ctx(tmp_path))  # noqa: E731
    assert logger().resolved_mode() == "offline"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    netrc.chmod(0o600)
    assert logger().resolved_mode() == "online"  # `wandb login` wrote a key
    netrc.unlink()
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert logger().resolved_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert logger().resolved_mode() == "disabled"
    assert logger(mode="offline").resolved_mode() == "offline"  # the YAML option wins


# --- TensorBoard ---------------------------------------------------------------------------


def test_tensorboard_event_files_hold_the_scalars_and_samples(real_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, metrics, samples = real_run
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    for key in ("reward/mean", "actor/kl", "response_length/mean", "timing/step"):
        events = acc.Scalars(key)
        assert [e.step for e in events] == [1, 2]
        assert [e.value for e in events] == pytest.approx([row[key] for row in metrics], rel=1e-6)
    text = acc.Tensors("samples/text_summary")
    assert [t.step for t in text] == [1, 2]
    table = text[-1].tensor_proto.string_val[0].decode()
    assert table.splitlines()[0].startswith("| prompt | response | answer | score |")
    assert len(table.splitlines()) == 2 + PROMPTS * N


def test_tensorboard_samples_markdown_escapes_cells():
    from hybridrl_trackers import samples_markdown

    md = samples_markdown([{"prompt": "a|b\nc", "response": "x" * 10, "score": 0.123456}], max_chars=4)
    assert md.splitlines() == ["| prompt | response | score |", "|---|---|---|", "| …\\|b<br>c | …xxxx | 0.1235 |"]
