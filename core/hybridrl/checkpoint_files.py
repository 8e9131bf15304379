"""A checkpoint's files before any is read: listed in ``meta.json`` with their sizes and
SHA-256, plain files and folders only, ``.pt`` files read as tensors and plain data.

The files list of ``meta.json`` is an integrity check, not a signature: a load refuses a
checkpoint with a file missing, added, truncated or changed since its run wrote it (a disk that
filled up, a copy cut short, a file swapped in or edited by hand), and a resume then falls back to
the newest checkpoint that loads (:func:`load_newest`). Whoever rewrites ``meta.json`` to match
can make a checkpoint load other numbers, but no more: that no code runs rests on the readers, not
on the list. A key kept outside the checkpoint (an HMAC) would refuse that rewrite too; there is
none, as it would guard only the numbers, against someone who can write the run's checkpoints but
not read its key (most often the same account, which can edit the code the run imports as well),
and it would bind checkpoints to the place that keeps the key.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import stat
from pathlib import Path

import torch

META = "meta.json"
# files of at most this size have their SHA-256 in meta.json, and .metadata whatever its size; larger
# ones (weights, optimizer state) their size only: hashing gigabytes at every save is not cheap
DIGEST_MAX_BYTES = 256 << 20
ALWAYS_DIGEST = (".metadata",)


class CheckpointError(FileNotFoundError):
    """A checkpoint that cannot be used: incomplete, corrupt, changed since its run wrote it, or
    holding a link. A FileNotFoundError, as a missing checkpoint is: the command line reports it as
    an error, not a traceback."""


def read_pt(file: Path):
    """A ``.pt`` file of a checkpoint: tensors and plain data only (``weights_only``), or CheckpointError."""
    try:
        return torch.load(file, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{file} holds more than tensors and plain data: {refused(e)}; it is not loaded.") from e
    except Exception as e:
        raise CheckpointError(f"{file} cannot be read: {type(e).__name__}: {' '.join(str(e).split())}") from e


def refused(error: pickle.UnpicklingError) -> str:
    """What ``torch.load(weights_only=True)`` refused, in one line (its message is several paragraphs)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line.rstrip(".") for line in lines if "GLOBAL" in line), " ".join(lines))


def file_list(path: Path) -> dict[str, dict]:
    """Every file under ``path`` but meta.json, by relative path: its size, and its SHA-256 when it is
    ``.metadata`` or at most DIGEST_MAX_BYTES long."""
    files = {}
    for root, dirs, names in os.walk(path):
        dirs.sort()
        for name in sorted(names):
            file = Path(root, name)
            rel = file.relative_to(path).as_posix()
            if rel == META:
                continue
            size = file.stat().st_size
            files[rel] = {"size": size}
            if size <= DIGEST_MAX_BYTES or name in ALWAYS_DIGEST:
                files[rel]["sha256"] = sha256(file)
    return files


def sha256(file: Path) -> str:
    with open(file, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_plain(path: Path) -> None:
    """Refuse a checkpoint holding a symbolic link, or anything but plain files and folders: a reader
    or a copy that followed one would read a file from outside the checkpoint (or hang on a pipe)."""

    def refuse(error: OSError):
        raise CheckpointError(f"{error.filename} cannot be read: {error.strerror}") from error

    for root, dirs, names in os.walk(path, onerror=refuse):  # links to folders are listed, not entered
        for name in dirs + names:
            item = Path(root, name)
            mode = item.lstat().st_mode
            if stat.S_ISLNK(mode):
                raise CheckpointError(
                    f"{item} is a symbolic link (to {os.readlink(item)}): a checkpoint holds the files its run "
                    "wrote, and links in it are not followed. Put the file itself there, or use another checkpoint."
                )
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise CheckpointError(f"{item} is not a plain file or folder; a checkpoint holds only those.")


def verify(path: Path) -> dict:
    """Check the checkpoint at ``path`` against its ``meta.json``; returns that meta.

    Refused with :class:`CheckpointError` naming the file: a link in it (:func:`check_plain`), no
    meta.json or one without its files list (checkpoints of earlier versions have none), a file
    missing, one it does not list, or one whose size or SHA-256 differs from what was written."""
    path = Path(path)
    if path.is_symlink():
        raise CheckpointError(f"{path} is a symbolic link (to {os.readlink(path)}); a checkpoint is a folder.")
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint folder.")
    check_plain(path)
    meta_file = path / META
    try:
        meta = json.loads(meta_file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"Checkpoint {path} is incomplete: {META} is missing.") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{meta_file} cannot be read: {e}") from e
    files = meta.get("files") if isinstance(meta, dict) else None
    if not isinstance(files, dict):
        raise CheckpointError(
            f"{meta_file} does not list the checkpoint's files with their digests (a checkpoint of an earlier "
            "hybridrl, or one edited), so they cannot be checked and it is not loaded. Export its policy "
            "(hybridrl export) and start a new run from that folder."
        )
    found = files_under(path)
    if extra := sorted(found - files.keys()):
        raise CheckpointError(f"{path / extra[0]} is not one of the files its run wrote ({META} does not list it).")
    for rel, want in sorted(files.items()):
        file = path / rel
        if rel not in found:
            raise CheckpointError(f"Checkpoint {path} is incomplete: {rel} is missing.")
        size = file.stat().st_size
        if size != want.get("size"):
            raise CheckpointError(f"{file} has {size} bytes, not the {want.get('size')} written: truncated or changed.")
        if "sha256" in want and sha256(file) != want["sha256"]:
            raise CheckpointError(f"{file} differs from the file its run wrote (SHA-256 in {meta_file}).")
        if "sha256" not in want and (size <= DIGEST_MAX_BYTES or file.name in ALWAYS_DIGEST):
            raise CheckpointError(f"{meta_file} holds no SHA-256 of {rel}; it is not loaded unchecked.")
    return meta


def files_under(path: Path) -> set[str]:
    """Relative paths of the files under ``path``, but meta.json."""
    files = {Path(root, name).relative_to(path).as_posix() for root, _, names in os.walk(path) for name in names}
    return files - {META}
