"""A checkpoint's files before any is read: listed in ``meta.json`` with their sizes and
SHA-256, plain files and folders only, ``.pt`` files read as tensors and plain data.

Every file's SHA-256 is of the whole file, whatever its size, and no large file is read twice for it:
see :class:`HashedFile` (the files hybridrl writes) and :func:`hash_written` (those a library writes).

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
import io
import json
import os
import pickle
import re
import stat
from pathlib import Path

import torch

META = "meta.json"
# the old format (checkpoints of an earlier hybridrl) listed the files over this size, but .metadata, by their size
# alone; such an entry is still accepted. A checkpoint written now has the SHA-256 of every file.
DIGEST_MAX_BYTES = 256 << 20
ALWAYS_DIGEST = (".metadata",)
# who wrote a checkpoint's file: rank R its rank-R.pt and torch.distributed.checkpoint's __R_N.distcp; rank 0 the rest
OWNER = re.compile(r"^(?:__(\d+)_|rank-(\d+)\.pt$)")


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


def file_list(path: Path, digests: dict[str, str] | None = None) -> dict[str, dict]:
    """Every file under ``path`` but meta.json, by relative path: its size and SHA-256, that of ``digests``
    (taken as the save wrote it) where there, else read now."""
    digests = digests or {}
    files = {rel: path / rel for rel in sorted(files_under(path))}
    return {rel: {"size": f.stat().st_size, "sha256": digests.get(rel) or sha256(f)} for rel, f in files.items()}


def hash_written(root: Path, rank: int) -> dict[str, str]:
    """The SHA-256 of each file under ``root`` that this rank wrote (:data:`OWNER`), by relative path: the
    files a library wrote (safetensors, the tokenizer's, torch.distributed.checkpoint's), hashed in one
    streaming pass right after it wrote them, while their pages are still in the OS cache (a library's
    writer cannot be hashed as it writes), so that no file is read a second time later."""
    owners = {rel: OWNER.match(Path(rel).name) for rel in sorted(files_under(root))}
    return {rel: sha256(root / rel) for rel, m in owners.items() if (int(m[1] or m[2]) if m else 0) == rank}


class HashedFile(io.BufferedWriter):
    """A checkpoint's file written through ``with HashedFile(root, rel, digests) as f: torch.save(x, f)``: its
    bytes are hashed as they are written and, closed without an error, its SHA-256 put in ``digests`` under
    ``rel``, so that a large file (the optimizer's state) is never read back for it."""

    def __init__(self, root: Path, rel: str, digests: dict[str, str]):
        super().__init__(io.FileIO(Path(root, rel), "wb"))
        self.rel, self.digests, self.sha = rel, digests, hashlib.sha256()

    def write(self, data) -> int:
        self.sha.update(data)
        return super().write(data)

    def __exit__(self, error, *rest) -> None:
        super().__exit__(error, *rest)
        if error is None:
            self.digests[self.rel] = self.sha.hexdigest()


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


def verify(path: Path, under: str = "", share: tuple[int, int] | None = (0, 1)) -> dict:
    """Check the checkpoint at ``path`` against its ``meta.json``; returns that meta.

    Refused with :class:`CheckpointError` naming the file: a link in it (:func:`check_plain`), no
    meta.json or one without its files list (checkpoints of earlier versions have none), and among the
    files under ``under`` (all; export and eval check ``policy/``, the files they read) one missing, one
    it does not list, or one whose size or SHA-256 differs from what was written. Every size is checked
    first (cheap), then the SHA-256 of the whole of each file; ``share`` (k, n): of the k-th file and every
    n-th after it alone (a resume under torchrun: each rank hashes its share, and their errors are agreed),
    None: of none. An entry of the old format, a file over DIGEST_MAX_BYTES with its size alone, is
    checked by its size."""
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
            "hybridrl, or one edited), so they cannot be checked and it is not loaded. Its policy/ is a plain "
            "model folder: start a new run from it (model.path)."
        )
    found = {rel for rel in files_under(path) if rel.startswith(under)}
    if extra := sorted(found - files.keys()):
        raise CheckpointError(f"{path / extra[0]} is not one of the files its run wrote ({META} does not list it).")
    listed = sorted(rel for rel in files if rel.startswith(under))
    for rel in listed:  # the sizes first: cheap
        file, want = path / rel, files[rel]
        if rel not in found:
            raise CheckpointError(f"Checkpoint {path} is incomplete: {rel} is missing.")
        size = file.stat().st_size
        if size != want.get("size"):
            raise CheckpointError(f"{file} has {size} bytes, not the {want.get('size')} written: truncated or changed.")
        if "sha256" not in want and (size <= DIGEST_MAX_BYTES or file.name in ALWAYS_DIGEST):
            raise CheckpointError(f"{meta_file} holds no SHA-256 of {rel}; it is not loaded unchecked.")
    for rel in listed[share[0] :: share[1]] if share else []:
        if "sha256" in files[rel] and sha256(path / rel) != files[rel]["sha256"]:
            raise CheckpointError(f"{path / rel} differs from the file its run wrote (SHA-256 in {meta_file}).")
    return meta


def files_under(path: Path) -> set[str]:
    """Relative paths of the files under ``path``, but meta.json."""
    files = {Path(root, name).relative_to(path).as_posix() for root, _, names in os.walk(path) for name in names}
    return files - {META}
