"""Checkpoints that are never half-written, and exact resume.

A checkpoint is a directory ``RUN_DIR/checkpoints/step-000010/`` holding:

- ``policy/``: the policy as a plain Hugging Face folder (config, safetensors, tokenizer),
  loadable by transformers and vLLM as it is;
- ``optimizer.pt``: optimizer and LR-scheduler state;
- ``state.pt``: step, RNG states, the prompt order position, and the state of every
  component that has ``state_dict()`` (the algorithm's KL controller or critic, rewards'
  running statistics);
- ``meta.json``: step, hybridrl version, sharding strategy and world size, for people and
  for the resume check.

A sharded strategy (``fsdp`` under torchrun) keeps ``policy/`` (gathered on rank 0, for
export) and adds:

- ``sharded/``: the policy's and the optimizer's shards, written by every rank with
  torch.distributed.checkpoint (``.metadata`` and one ``__R_0.distcp`` per rank);
  ``optimizer.pt`` then holds only the LR scheduler;
- ``rank-R.pt`` for ranks R > 0: that rank's RNG states and component state (``state.pt``
  holds rank 0's).

It is written into a temporary sibling directory and renamed into place (by rank 0, after
every rank has written its part), so a crash or a kill during the save leaves the previous
checkpoints as they were. Everything is loaded with ``torch.load(weights_only=True)``: a
checkpoint cannot run code. A sharded checkpoint resumes on the same strategy and world size.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path

import torch

from hybridrl import distributed

STEP_DIR = re.compile(r"^step-(\d+)$")

PRIVATE_DIR, PRIVATE_FILE = 0o700, 0o600
# the run's files that hybridrl writes and that hold its config or its users' data
RUN_FILES = ("config.yaml", "metrics.jsonl", "samples.jsonl", "online.sqlite", "online.sqlite-wal", "online.sqlite-shm")


@contextlib.contextmanager
def private_files():
    """Files and folders created inside are their owner's alone (umask 077). The umask is the process's:
    for the setup of a process that serves, not for a library call among others."""
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


def make_private(run_dir: Path) -> None:
    """The run files of ``run_dir`` that exist (``RUN_FILES``) readable and writable by their owner only."""
    for name in RUN_FILES:
        with contextlib.suppress(OSError):  # absent, or another user's
            os.chmod(Path(run_dir) / name, PRIVATE_FILE)


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def step_of(path: Path) -> int:
    m = STEP_DIR.match(Path(path).name)
    if not m:
        raise ValueError(f"{path} is not a checkpoint directory (expected a name like step-000010).")
    return int(m.group(1))


def seed_everything(seed: int) -> None:
    """Seed Python's, torch's and (when installed) numpy's random state."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss)
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(trainer, step: int) -> Path:
    """Write the trainer's state for ``step`` atomically; returns the checkpoint directory."""
    from hybridrl import __version__

    rank, main = distributed.rank(), distributed.is_main()
    root = checkpoint_dir(trainer.run_dir)
    final = root / f"step-{step:06d}"
    tmp = None
    if main:
        root.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
        make_private(trainer.run_dir)
        tmp = tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root)
    tmp = Path(distributed.broadcast_object(tmp))  # every rank writes its part into rank 0's directory
    try:
        trainer.strategy.save_model(trainer.policy, tmp / "policy")
        sharded = trainer.strategy.save_sharded(trainer.policy, trainer.optimizer, tmp / "sharded")
        components = {name: c.state_dict() for name, c in trainer.stateful_components().items()}
        if not main:
            torch.save({"rng": rng_state(), "components": components}, tmp / f"rank-{rank}.pt")
        else:
            trainer.tokenizer.save_pretrained(tmp / "policy")
            optimizer = {} if sharded else {"optimizer": trainer.optimizer.state_dict()}
            torch.save({**optimizer, "scheduler": trainer.scheduler.state_dict()}, tmp / "optimizer.pt")
            torch.save(
                {"step": step, "rng": rng_state(), "prompts": trainer.prompts.state_dict(), "components": components},
                tmp / "state.pt",
            )
            meta = {
                "step": step,
                "hybridrl": __version__,
                "sharding": trainer.config.sharding.strategy,
                "world_size": distributed.world_size(),
            }
            (tmp / "meta.json").write_text(json.dumps(meta) + "\n")
        distributed.barrier()  # every rank's part is written
        if main:
            _fsync_dir(tmp)
            if final.exists():  # a re-save of the same step (resumed run): replace it whole
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(root)
        distributed.barrier()
    except BaseException:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def load_checkpoint(trainer, path: Path) -> int:
    """Restore the trainer from ``path``; returns the step it holds."""
    path = Path(path)
    for name in ("policy", "optimizer.pt", "state.pt"):
        if not (path / name).exists():
            raise FileNotFoundError(f"Checkpoint {path} is incomplete: {name} is missing.")
    check_layout(trainer, path)
    opt = torch.load(path / "optimizer.pt", weights_only=True)
    if (path / "sharded").is_dir():
        trainer.strategy.load_sharded(trainer.policy, trainer.optimizer, path / "sharded")
    else:
        trainer.strategy.load_model(trainer.policy, path / "policy")
        trainer.optimizer.load_state_dict(opt["optimizer"])
    trainer.scheduler.load_state_dict(opt["scheduler"])
    state = torch.load(path / "state.pt", weights_only=True)
    trainer.prompts.load_state_dict(state["prompts"])
    if distributed.rank() > 0:  # this rank's own RNG and component state
        state |= torch.load(path / f"rank-{distributed.rank()}.pt", weights_only=True)
    components = trainer.stateful_components()
    for name, sub in state["components"].items():
        if name not in components:
            raise ValueError(f"Checkpoint {path} holds state for '{name}', which this run does not have.")
        components[name].load_state_dict(sub)
    set_rng_state(state["rng"])
    return int(state["step"])


def check_layout(trainer, path: Path) -> None:
    """A checkpoint resumes on the sharding strategy and world size that wrote it."""
    meta_file = Path(path) / "meta.json"
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    sharded = (Path(path) / "sharded").is_dir()
    saved = (meta.get("sharding", "fsdp" if sharded else "single"), int(meta.get("world_size", 1)))
    now = (trainer.config.sharding.strategy, distributed.world_size())
    if sharded != trainer.strategy.multi_process or (sharded and saved != now):
        raise ValueError(
            f"Checkpoint {path} was written by sharding strategy '{saved[0]}' on {saved[1]} process(es); this run "
            f"uses '{now[0]}' on {now[1]}. Resume with the same strategy and world size (torchrun "
            f"--nproc-per-node), or export its policy (hybridrl export) and start a new run from that folder."
        )


def latest_checkpoint_of_run(run_dir: Path, main: bool) -> Path | None:
    """The checkpoint a resumed run continues from (temporary directories of a killed save removed
    first, by rank 0); None, said once, when the run has none yet."""
    if main:
        clean_partial(run_dir)
    distributed.barrier()
    path = latest_checkpoint(run_dir)
    if path is None and main:
        print(f"no checkpoint in {run_dir}: starting at step 1", flush=True)
    return path


def drop_logs_after(run_dir: Path, step: int, main: bool) -> None:
    """Drop what an interrupted run logged after the checkpoint it resumes from."""
    if main:
        for name in ("metrics.jsonl", "samples.jsonl"):
            truncate_jsonl(Path(run_dir) / name, step)


def rotate(run_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints (and stale temporary dirs)."""
    removed = []
    found = list_checkpoints(run_dir)
    for old in found[: max(0, len(found) - keep_last)] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
        removed.append(old)
    return removed


def clean_partial(run_dir: Path) -> None:
    """Remove temporary directories left by a save that was killed."""
    root = checkpoint_dir(run_dir)
    if root.is_dir():
        for p in root.glob(".step-*.tmp-*"):
            shutil.rmtree(p, ignore_errors=True)


def truncate_jsonl(path: Path, max_step: int) -> None:
    """Keep only rows with ``step <= max_step`` (what an interrupted run logged past its checkpoint goes)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= max_step:
                keep.append(line)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE), "w") as f:
        f.write("".join(line + "\n" for line in keep))
    os.chmod(tmp, PRIVATE_FILE)  # a .tmp left by a kill keeps its mode
    os.replace(tmp, path)


def export(path: Path, out: Path, merged: bool = False) -> Path:
    """Copy a checkpoint's policy to ``out`` as a plain HF model folder. A LoRA checkpoint holds the
    adapter (peft's folder); ``merged`` writes the base model with the adapter merged in instead."""
    path, out = Path(path), Path(out)
    policy = path / "policy"
    adapter = (policy / "adapter_config.json").is_file()
    if not adapter and not (policy / "config.json").is_file():
        raise FileNotFoundError(f"{path} holds no policy/config.json: is it a checkpoint directory (step-N)?")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose a new directory.")
    if merged and adapter:
        from peft import AutoPeftModelForCausalLM
        from transformers import AutoTokenizer

        model = AutoPeftModelForCausalLM.from_pretrained(policy, dtype=torch.float32).merge_and_unload()
        model.save_pretrained(out)
        AutoTokenizer.from_pretrained(policy).save_pretrained(out)
        return out
    shutil.copytree(policy, out, dirs_exist_ok=True)
    return out


def _fsync_dir(path: Path) -> None:
    for f in [path, *path.rglob("*")]:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)
