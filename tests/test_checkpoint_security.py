"""Checkpoints run no code and read nothing from outside themselves; a damaged newest one is
skipped on resume. The fsdp reader on a process group of one, and a resume by two torchrun ranks."""

import json
import os
import pickle
import re
import subprocess
import sys

import pytest
import torch
import yaml
from hybridrl_testing import small_model, torchrun
from hybridrl_testing.runs import checkpointed_run

from hybridrl import checkpoint as ckpt
from hybridrl import distributed
from hybridrl.config import load_config
from hybridrl.run import build_run
from hybridrl.trainer import Trainer


class Payload:
    """Unpickled, it creates the folder ``marker``: proof that a loader ran code from a file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    """A run with checkpoints step-000001 and step-000002, copied afresh by each test."""
    run = tmp_path_factory.mktemp("trained") / "run"
    Trainer(build_run(load_config(data=checkpointed_run(tiny_model, run)))).train()
    return run


@pytest.fixture
def run(trained, tmp_path):
    import shutil

    shutil.copytree(trained, tmp_path / "run", symlinks=True)
    return tmp_path / "run"


def resume(tiny_model, run, steps=2) -> Trainer:
    trainer = Trainer(
        build_run(load_config(data=checkpointed_run(tiny_model, run, steps=steps), overrides=["trainer.resume=true"]))
    )
    trainer.train()
    return trainer


def relist(path):
    """meta.json rewritten to match the files as they are now: what someone who edits a checkpoint can do."""
    meta = json.loads((path / "meta.json").read_text())
    meta["files"] = ckpt.file_list(path)
    (path / "meta.json").write_text(json.dumps(meta))


# -- fsdp: torch.distributed.checkpoint's pickles -------------------------------------------------


@pytest.fixture
def fsdp(tmp_path):
    from hybridrl.builtin.sharding_fsdp import FSDPStrategy
    from hybridrl.components import RunContext

    ctx = RunContext("", None, torch.device("cpu"), torch.float32, 0, tmp_path)
    strategy = FSDPStrategy(FSDPStrategy.Options(), ctx)
    model = strategy.wrap(small_model("qwen2").train())
    yield strategy, model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    distributed.teardown()


def test_a_crafted_fsdp_metadata_runs_no_code(fsdp, tmp_path):
    strategy, model, optimizer = fsdp
    strategy.save_sharded(model, optimizer, tmp_path / "sharded")
    marker = tmp_path / "ran"
    (tmp_path / "sharded" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(ckpt.CheckpointError, match=r"posix\.mkdir is not part of a torch.distributed.checkpoint"):
        strategy.load_sharded(model, optimizer, tmp_path / "sharded")
    assert not marker.exists()


def test_a_crafted_optimizer_entry_in_the_shards_runs_no_code(fsdp, tmp_path):
    """torch's planner reads the entries that are not tensors (the optimizer's lr, betas) with
    torch.load(weights_only=False)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    strategy, model, optimizer = fsdp
    model_state, optim_state = get_state_dict(model, optimizer)
    marker = tmp_path / "ran"
    optim_state["param_groups"][0]["lr"] = Payload(marker)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp_path / "sharded"))
    with pytest.raises(
        ckpt.CheckpointError, match=r"entry optimizer.param_groups.0.lr holds more than plain data: .*posix.mkdir"
    ):
        strategy.load_sharded(model, optimizer, tmp_path / "sharded")
    assert not marker.exists()


def test_fsdp_metadata_may_point_only_at_files_of_its_folder(fsdp, tmp_path):
    import shutil

    strategy, model, optimizer = fsdp
    strategy.save_sharded(model, optimizer, tmp_path / "sharded")
    shutil.copy(tmp_path / "sharded" / "__0_0.distcp", tmp_path)  # a file outside the folder, readable
    file = tmp_path / "sharded" / ".metadata"
    metadata = pickle.loads(file.read_bytes())  # written by this test: safe to unpickle
    for info in metadata.storage_data.values():
        info.relative_path = "../__0_0.distcp"
    file.write_bytes(pickle.dumps(metadata))
    with pytest.raises(ckpt.CheckpointError, match=r"points at '../__0_0.distcp', which is not a file of"):
        strategy.load_sharded(model, optimizer, tmp_path / "sharded")


# -- what a load checks: meta.json's list of files, links --------------------------------------------


def test_state_files_run_no_code_even_with_meta_json_rewritten(tiny_model, run, tmp_path):
    trainer = Trainer(build_run(load_config(data=checkpointed_run(tiny_model, run), overrides=["trainer.resume=true"])))
    path = ckpt.latest_checkpoint(run)
    marker = tmp_path / "ran"
    with open(path / "state.pt", "wb") as f:
        pickle.dump({"step": Payload(marker)}, f, protocol=2)
    with pytest.raises(ckpt.CheckpointError, match=r"step-000002/state.pt has \d+ bytes, not the \d+ written"):
        ckpt.load_checkpoint(trainer.run, trainer.stateful_components(), path)
    relist(path)  # the list is no signature; the reader is what refuses
    with pytest.raises(ckpt.CheckpointError, match=r"state.pt holds more than tensors and plain data: .*posix.mkdir"):
        ckpt.load_checkpoint(trainer.run, trainer.stateful_components(), path)
    assert not marker.exists()


def flip_last_byte(file):
    data = file.read_bytes()
    file.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # the same size: only the digest tells


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: flip_last_byte(p / "policy" / "config.json"), r"policy/config.json differs from the file"),
        (lambda p: (p / "optimizer.pt").unlink(), r"step-000002 is incomplete: optimizer.pt is missing"),
        (lambda p: (p / "policy" / "extra.safetensors").write_bytes(b"x"), r"policy/extra.safetensors is not one of"),
        (lambda p: (p / "meta.json").write_text('{"step": 2}'), r"meta.json does not list the checkpoint's files"),
    ],
    ids=["changed", "missing", "added", "unlisted"],
)
def test_a_checkpoint_changed_since_its_run_wrote_it_is_refused(tiny_model, run, damage, message):
    trainer = Trainer(build_run(load_config(data=checkpointed_run(tiny_model, run), overrides=["trainer.resume=true"])))
    path = ckpt.latest_checkpoint(run)
    damage(path)
    with pytest.raises(ckpt.CheckpointError, match=message):
        ckpt.load_checkpoint(trainer.run, trainer.stateful_components(), path)


# -- resume: the newest checkpoint that loads ----------------------------------------------------------


def test_resume_skips_a_truncated_newest_checkpoint(tiny_model, run, capfd):
    newest = run / "checkpoints" / "step-000002" / "state.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    trainer = resume(tiny_model, run, steps=3)
    out, err = capfd.readouterr()
    assert trainer.start_step == 1 and "resumed from" in out and "step-000001 (step 1)" in out
    assert "warning: checkpoint step-000002 cannot be loaded (" in err
    assert "state.pt has 100 bytes, not the" in err and "resuming from step-000001 instead" in err
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_resume_skips_a_checkpoint_with_a_link(tiny_model, run, capfd):
    """A link in the newest checkpoint (its weights, pointing at the previous one's) is refused, not read."""
    newest, previous = run / "checkpoints" / "step-000002", run / "checkpoints" / "step-000001"
    (newest / "policy" / "model.safetensors").unlink()
    (newest / "policy" / "model.safetensors").symlink_to(previous / "policy" / "model.safetensors")
    trainer = resume(tiny_model, run)
    assert trainer.start_step == 1
    err = capfd.readouterr().err
    assert (
        f"checkpoint step-000002 cannot be loaded ({newest / 'policy' / 'model.safetensors'} is a symbolic link" in err
    )


def test_no_checkpoint_that_loads_is_one_error_listing_each(tiny_model, run, tmp_path):
    for step in (1, 2):
        (run / "checkpoints" / f"step-00000{step}" / "optimizer.pt").write_bytes(b"")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(checkpointed_run(tiny_model, run, steps=3)))
    out = subprocess.run(
        [sys.executable, "-m", "hybridrl.cli", "train", str(cfg), "--resume"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stderr
    assert f"error: No checkpoint of {run} can be loaded; tried, newest first:\n  step-000002: " in out.stderr
    assert "\n  step-000001: " in out.stderr and "optimizer.pt has 0 bytes" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.torchrun
def test_two_torchrun_ranks_skip_the_same_damaged_fsdp_checkpoints(tiny_model, tmp_path):
    """Step 4's .metadata carries a pickle payload, step 3's rank-1.pt another, each with meta.json
    rewritten to match (so the readers are what refuse them); step 2 lost the end of rank 1's shard.
    Both ranks skip all three, also where only rank 1 failed, resume from step 1, and no payload runs."""
    run, cfg = tmp_path / "run", tmp_path / "cfg.yaml"
    data = checkpointed_run(tiny_model, run, steps=4, keep_last=4)
    data["sharding"] = {"strategy": "fsdp"}
    cfg.write_text(yaml.safe_dump(data))
    proc = torchrun(["-m", "hybridrl.cli", "train", str(cfg)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    step2, step3, step4 = (run / "checkpoints" / f"step-00000{n}" for n in (2, 3, 4))
    marker = tmp_path / "ran"
    (step4 / "sharded" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    relist(step4)
    (step3 / "rank-1.pt").write_bytes(pickle.dumps(Payload(marker), protocol=2))
    relist(step3)
    shard = step2 / "sharded" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-8])

    proc = torchrun(["-m", "hybridrl.cli", "train", str(cfg), "--resume"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not marker.exists()
    assert proc.stdout.count("resumed from") == 1 and "step-000001 (step 1)" in proc.stdout
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: checkpoint")]
    assert len(warnings) == 3, proc.stderr[-4000:]  # rank 0 speaks
    assert warnings[0].startswith(f"warning: checkpoint step-000004 cannot be loaded ({step4 / 'sharded'} cannot ")
    assert "posix.mkdir is not part of a torch.distributed.checkpoint .metadata" in warnings[0]
    assert warnings[1].startswith(f"warning: checkpoint step-000003 cannot be loaded (rank 1: {step3 / 'rank-1.pt'} ")
    assert "holds more than tensors and plain data: Trying to load unsupported GLOBAL posix.mkdir" in warnings[1]
    assert warnings[2].startswith(f"warning: checkpoint step-000002 cannot be loaded ({shard} has ")
    assert all(w.endswith("resuming from step-000001 instead.") for w in warnings)
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_rotation_counts_only_the_runs_own_checkpoints(tmp_path):
    """A stray folder named like a later step, or one that does not verify, is neither counted nor
    deleted: keep_last: 1 keeps the checkpoint just written (it deleted it for step-999999 before)."""
    from hybridrl.checkpoint_files import META, file_list

    root = ckpt.checkpoint_dir(tmp_path)

    def written(step: int):
        path = root / f"step-{step:06d}"
        path.mkdir(parents=True)
        (path / "state.pt").write_bytes(b"x" * step)
        (path / META).write_text(json.dumps({"step": step, "files": file_list(path)}))
        return path

    old, damaged, newest = written(1), written(2), written(3)
    (damaged / "state.pt").write_bytes(b"changed")  # no longer what its meta.json says
    stray = root / "step-999999"
    stray.mkdir()
    assert ckpt.rotate(tmp_path, 1, newest) == [old]
    assert not old.exists() and damaged.is_dir() and newest.is_dir() and stray.is_dir()
    assert ckpt.rotate(tmp_path, 2, newest) == []  # the damaged one is not counted: nothing else to drop


# -- full-file digests; eval checks the checkpoint as a resume does (export too: plugins/export/tests) ----


def test_every_file_is_listed_with_its_full_sha256_and_a_same_size_change_of_a_large_one_is_refused(
    tiny_model, tmp_path, monkeypatch
):
    """Files over DIGEST_MAX_BYTES (patched down: the weights, the optimizer state are such files) had their
    size alone in meta.json, so a same-size change passed. Now every file has the SHA-256 taken as it was
    written; a size-only entry (the old format) is still accepted for such a file."""
    from hybridrl import checkpoint_files

    monkeypatch.setattr(checkpoint_files, "DIGEST_MAX_BYTES", 64)
    trainer = Trainer(build_run(load_config(data=checkpointed_run(tiny_model, tmp_path / "run"))))
    path = ckpt.save_checkpoint(trainer.run, trainer.stateful_components(), 1)
    files = json.loads((path / "meta.json").read_text())["files"]
    assert {"optimizer.pt", "state.pt", "policy/model.safetensors"} <= files.keys()
    assert all(entry.get("sha256") == checkpoint_files.sha256(path / rel) for rel, entry in files.items())
    weights = path / "policy" / "model.safetensors"
    flip_last_byte(weights)
    with pytest.raises(ckpt.CheckpointError, match=re.escape(f"{weights} differs from the file its run wrote")):
        ckpt.verify(path)
    assert sum(not _verifies(path, share=(k, 2)) for k in (0, 1)) == 1  # two ranks, each hashing half the files
    flip_last_byte(weights)  # back as written; then meta.json as an earlier hybridrl wrote it: its size alone
    meta = json.loads((path / "meta.json").read_text())
    del meta["files"]["policy/model.safetensors"]["sha256"]
    (path / "meta.json").write_text(json.dumps(meta))
    assert ckpt.verify(path)["step"] == 1


def _verifies(path, **kwargs) -> bool:
    try:
        ckpt.verify(path, **kwargs)
    except ckpt.CheckpointError:
        return False
    return True


def test_eval_checks_the_checkpoint_it_evaluates(tiny_model, run):
    from hybridrl import evaluation

    path = ckpt.latest_checkpoint(run)
    cfg = load_config(data=checkpointed_run(tiny_model, run))
    assert evaluation.model_to_evaluate(cfg, str(path), None) == (f"checkpoint {path}", 2)
    flip_last_byte(path / "policy" / "config.json")
    with pytest.raises(ckpt.CheckpointError, match=re.escape(f"{path / 'policy' / 'config.json'} differs from")):
        evaluation.model_to_evaluate(load_config(data=checkpointed_run(tiny_model, run)), str(path), None)
