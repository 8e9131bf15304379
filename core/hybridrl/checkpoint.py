"""Checkpoints that are never half-written, exact resume, and checkpoints that cannot run code.

A checkpoint is a directory ``RUN_DIR/checkpoints/step-000010/`` holding:

- ``policy/``: the policy as a plain Hugging Face folder (config, safetensors, tokenizer),
  loadable by transformers and vLLM as it is;
- ``optimizer.pt``: optimizer and LR-scheduler state;
- ``state.pt``: step, RNG states, the prompt order position, and the state of every
  component that has ``state_dict()`` (the algorithm's KL controller or critic, rewards'
  running statistics);
- ``meta.json``: step, hybridrl version, sharding strategy and world size, for people and
  for the resume check, and ``files``: every other file of the checkpoint with its size and SHA-256
  (taken as the file is written: :mod:`hybridrl.checkpoint_files`).

A sharded strategy (``fsdp`` under torchrun) keeps ``policy/`` (gathered on rank 0, for
``hybridrl export``, the hybridrl-export plugin) and adds:

- ``sharded/``: the policy's and the optimizer's shards, written by every rank with
  torch.distributed.checkpoint (``.metadata`` and one ``__R_0.distcp`` per rank);
  ``optimizer.pt`` then holds only the LR scheduler;
- ``rank-R.pt`` for ranks R > 0: that rank's RNG states and component state (``state.pt``
  holds rank 0's).

It is written into a temporary sibling directory and renamed into place (by rank 0, after
every rank has written its part and rank 0 has listed the files in ``meta.json``), so a crash or
a kill during the save leaves the previous checkpoints as they were. A sharded checkpoint
resumes on the same strategy and world size.

A checkpoint cannot run code, whoever wrote it. Its readers build tensors and plain data only:
``torch.load(weights_only=True)`` for the ``.pt`` files, safetensors for the weights, and for
``sharded/`` :func:`load_distributed`, which reads torch.distributed.checkpoint's pickles
through allow-lists (torch 2.13 has no reader of ``.metadata`` without pickle; torch's own runs
any code the file names). A checkpoint holding a symbolic link, or anything but plain files and
folders, is refused by resume and by ``hybridrl export`` (both through
:func:`~hybridrl.checkpoint_files.verify`), so neither reads nor copies a file from outside it.

The files list of ``meta.json`` and what it guards: :mod:`hybridrl.checkpoint_files`.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from hybridrl import distributed
from hybridrl.checkpoint_files import META, CheckpointError, HashedFile, file_list, hash_written, read_pt, verify

STEP_DIR = re.compile(r"^step-(\d+)$")
PRIVATE_DIR, PRIVATE_FILE = 0o700, 0o600
# the run's files that the core writes and that hold its config or its data (a plugin keeps its own files private)
RUN_FILES = ("config.yaml", "metrics.jsonl", "samples.jsonl")


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
    with contextlib.suppress(ImportError):
        import numpy as np

        np.random.seed(seed % 2**32)


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


def save_checkpoint(run, components: dict, step: int, weights_only: bool = False) -> Path:
    """Write the state of ``run`` (a :class:`~hybridrl.run.Run`) and of ``components`` (name: an
    object with ``state_dict``) for ``step`` atomically; returns the checkpoint directory.
    ``weights_only``: without the optimizer's state (``trainer.save_final: weights``): the policy,
    the LR schedule and the run's state; a resume from it starts the optimizer afresh."""
    from hybridrl import __version__

    rank, main = distributed.rank(), distributed.is_main()
    root = checkpoint_dir(run.run_dir)
    final = root / f"step-{step:06d}"
    tmp = None
    if main:
        root.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
        make_private(run.run_dir)
        tmp = tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root)
    tmp = Path(distributed.broadcast_object(tmp))  # every rank writes its part into rank 0's directory
    try:
        run.strategy.save_model(run.policy, tmp / "policy")
        if main:
            run.tokenizer.save_pretrained(tmp / "policy")
        sharded = not weights_only and run.strategy.save_sharded(run.policy, run.optimizer, tmp / "sharded")
        digests = hash_written(tmp, rank)  # what the libraries wrote, read once now while it is in the OS cache
        components = {name: c.state_dict() for name, c in components.items()}
        if not main:
            with HashedFile(tmp, f"rank-{rank}.pt", digests) as f:  # hashed as written: no second read
                torch.save({"rng": rng_state(), "components": components}, f)
        else:
            optimizer = {} if sharded or weights_only else {"optimizer": run.optimizer.state_dict()}
            with HashedFile(tmp, "optimizer.pt", digests) as f:
                torch.save({**optimizer, "scheduler": run.scheduler.state_dict()}, f)
            with HashedFile(tmp, "state.pt", digests) as f:
                torch.save(
                    {"step": step, "rng": rng_state(), "prompts": run.prompts.state_dict(), "components": components}, f
                )
        digests = {k: v for d in distributed.all_gather_objects(digests) for k, v in d.items()}  # all written
        if main:
            meta = {
                "step": step,
                "hybridrl": __version__,
                "sharding": run.config.sharding.strategy,
                "world_size": distributed.world_size(),
                "weights_only": weights_only,
                "files": file_list(tmp, digests),
            }
            (tmp / META).write_text(json.dumps(meta, indent=1) + "\n")
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


def load_checkpoint(run, components: dict, path: Path) -> int:
    """Restore ``run`` and ``components`` (name: an object with ``load_state_dict``) from ``path``;
    returns the step it holds. Collective under torchrun.

    Every file is first checked against ``meta.json`` (:func:`verify`) and the small files read;
    then the weights and the optimizer state are loaded and the rest applied. Raises
    :class:`CheckpointError` (on every rank together) when the checkpoint cannot be read, or a
    part of it does not load (the run may then hold part of it: load another one over it);
    ValueError when it was written by another sharding strategy or world size, or holds state for
    a component this run does not have.
    """
    path, rank = Path(path), distributed.rank()
    with _agreed(path):  # every rank reads first (and hashes its share): none goes into a collective load alone
        meta = verify(path, share=(rank, distributed.world_size()))
        opt = read_pt(path / "optimizer.pt")
        state = read_pt(path / "state.pt")
        if rank > 0:  # this rank's own RNG and component state
            state |= read_pt(path / f"rank-{rank}.pt")
    check_layout(run, path, meta)
    for name in state["components"]:
        if name not in components:
            raise ValueError(f"Checkpoint {path} holds state for '{name}', which this run does not have.")
    with _agreed(path):
        if (path / "sharded").is_dir():
            run.strategy.load_sharded(run.policy, run.optimizer, path / "sharded")
        else:
            run.strategy.load_model(run.policy, path / "policy")
            if "optimizer" in opt:
                run.optimizer.load_state_dict(opt["optimizer"])
            elif distributed.is_main():
                print(
                    f"note: checkpoint {path.name} holds the policy's weights without the optimizer's state "
                    "(trainer.save_final: weights); the optimizer starts afresh.",
                    file=sys.stderr,
                    flush=True,
                )
        run.scheduler.load_state_dict(opt["scheduler"])
        run.prompts.load_state_dict(state["prompts"])
        for name, sub in state["components"].items():
            components[name].load_state_dict(sub)
        set_rng_state(state["rng"])
    return int(state["step"])


@contextlib.contextmanager
def _agreed(path: Path):
    """Run the block on every rank; when it fails on any, raise one :class:`CheckpointError` on all of
    them, naming the ranks (under torchrun) and their errors."""
    error, said = None, None
    try:
        yield
    except CheckpointError as e:
        error, said = e, str(e)
    except Exception as e:  # whatever a damaged file makes a reader raise
        error, said = e, f"{path}: {type(e).__name__}: {e}"
    message = per_rank(distributed.all_gather_objects(said))
    if message is not None:
        raise CheckpointError(message) from error


def per_rank(errors: list[str | None]) -> str | None:
    """The errors of the ranks, in rank order (None: that rank had none), as one message: the error
    alone when every rank had it, else each error once after the ranks that had it; None if none."""
    ranks: dict[str, list[str]] = {}
    for r, e in enumerate(errors):
        if e is not None:
            ranks.setdefault(e, []).append(str(r))
    if len(ranks) == 1 and len(next(iter(ranks.values()))) == len(errors):
        return next(iter(ranks))
    return "; ".join(f"rank {', '.join(r)}: {e}" for e, r in ranks.items()) or None


def check_layout(run, path: Path, meta: dict) -> None:
    """A checkpoint resumes on the sharding strategy and world size that wrote it."""
    sharded = (Path(path) / "sharded").is_dir()
    saved = (meta.get("sharding", "fsdp" if sharded else "single"), int(meta.get("world_size", 1)))
    now = (run.config.sharding.strategy, distributed.world_size())
    weights_only = bool(meta.get("weights_only")) and saved == now  # the policy's folder: no shards to match
    if not weights_only and (sharded != run.strategy.multi_process or (sharded and saved != now)):
        raise ValueError(
            f"Checkpoint {path} was written by sharding strategy '{saved[0]}' on {saved[1]} process(es); this run "
            f"uses '{now[0]}' on {now[1]}. Resume with the same strategy and world size (torchrun "
            f"--nproc-per-node), or export its policy (hybridrl export) and start a new run from that folder."
        )


def load_newest(run, components: dict) -> tuple[Path, int] | None:
    """Load the newest checkpoint of ``run`` that loads (with ``components``); returns it and its step, or None
    (said once) when the run has none yet. Collective under torchrun: every rank tries the same
    checkpoints (rank 0's listing) and takes the same one.

    Temporary directories of a killed save are removed first (by rank 0). A checkpoint that does not
    load (:class:`CheckpointError`: a file missing, truncated or changed, a link inside) is skipped,
    with a warning naming it and the one used instead; it stays on disk (a later save of its step
    replaces it). When none loads, one CheckpointError lists each one tried and why.
    """
    run_dir, main = run.run_dir, distributed.is_main()
    if main:
        clean_partial(run_dir)
    found = distributed.broadcast_object(list_checkpoints(run_dir) if main else None)
    if not found:
        if main:
            print(f"no checkpoint in {run_dir}: starting at step 1", flush=True)
        return None
    skipped: list[tuple[Path, str]] = []
    for path in reversed(found):
        try:
            step = load_checkpoint(run, components, path)
        except CheckpointError as e:
            skipped.append((path, str(e)))
            continue
        if main:
            for bad, why in skipped:
                print(
                    f"warning: checkpoint {bad.name} cannot be loaded ({why}); resuming from {path.name} instead.",
                    file=sys.stderr,
                    flush=True,
                )
        return path, step
    tried = "\n".join(f"  {p.name}: {why}" for p, why in skipped)
    raise CheckpointError(
        f"No checkpoint of {run_dir} can be loaded; tried, newest first:\n{tried}\nRepair or remove them to "
        "resume, or start a new run (a checkpoint's policy folder can be exported with hybridrl export)."
    )


def drop_logs_after(run_dir: Path, step: int, main: bool) -> None:
    """Drop what an interrupted run logged after the checkpoint it resumes from."""
    if main:
        for name in ("metrics.jsonl", "samples.jsonl"):
            truncate_jsonl(Path(run_dir) / name, step)


def rotate(run_dir: Path, keep_last: int, newest: Path) -> list[Path]:
    """Delete the checkpoints older than ``newest`` (the one just written) beyond the newest
    ``keep_last``, counting and deleting only those that verify and hold their folder's step: a
    folder this run did not write (a stray ``step-999999``, a damaged or hand-made one) is never
    counted and never deleted, so it can never push the run's own newest checkpoint out."""
    ours = []
    for path in list_checkpoints(run_dir):
        if path == newest or step_of(path) >= step_of(newest):
            continue
        try:
            if int(verify(path, share=None).get("step", -1)) == step_of(path):  # listing, sizes, links: no re-read
                ours.append(path)
        except (CheckpointError, ValueError, TypeError):
            continue
    removed = ours[: max(0, len(ours) - (keep_last - 1))]
    for old in removed:
        shutil.rmtree(old, ignore_errors=True)
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


def _fsync_dir(path: Path) -> None:
    for f in [path, *path.rglob("*")]:
        with contextlib.suppress(OSError):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
