"""A checkpoint's policy written as a plain Hugging Face model folder, checked before it is read.

A checkpoint holding a symbolic link, or anything but plain files and folders, is refused (the core's
:func:`~hybridrl.checkpoint_files.verify`), so nothing is read or copied from outside it."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

from hybridrl.checkpoint_files import verify
from hybridrl.errors import ConfigError

DISK_FULL = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))  # how a writer's message says it


def export(path: Path, out: Path, merged: bool = False) -> Path:
    """Copy a checkpoint's policy to ``out`` as a plain HF model folder. A LoRA checkpoint holds the
    adapter (peft's folder); ``merged`` writes the base model with the adapter merged in instead.

    The policy's files are checked as a resume checks them (:func:`verify` of ``policy/``; the other files
    are not read, so a checkpoint whose optimizer state no longer resumes still exports); ``path`` may be
    a link to a checkpoint. A file with other hard links is copied into a new file like any other (its
    content was checked: the output shares no inode with anything). ``out`` is written beside and renamed
    into place: a full disk is one error naming the folder and its free space, and leaves nothing behind."""
    path, out = Path(path).resolve(), Path(out)
    policy = path / "policy"
    adapter = (policy / "adapter_config.json").is_file()
    if not adapter and not (policy / "config.json").is_file():
        raise FileNotFoundError(f"{path} holds no policy/config.json: is it a checkpoint directory (step-N)?")
    if out.is_file():
        raise ConfigError(f"{out} is a file; hybridrl export writes a folder. Give a new folder's path.")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose a new directory.")
    verify(path, under="policy/")
    (parent := out.absolute().parent).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    try:
        if merged and adapter:
            import torch
            from peft import AutoPeftModelForCausalLM
            from transformers import AutoTokenizer

            model = AutoPeftModelForCausalLM.from_pretrained(policy, dtype=torch.float32).merge_and_unload()
            model.save_pretrained(tmp)
            AutoTokenizer.from_pretrained(policy).save_pretrained(tmp)
        else:  # not copytree: it turns a full disk into a shutil.Error without its errno
            for file in sorted(policy.rglob("*")):  # a folder before its files
                if file.is_dir():
                    (tmp / file.relative_to(policy)).mkdir()
                else:
                    shutil.copy2(file, tmp / file.relative_to(policy))
        shutil.copymode(policy, tmp)  # the policy folder's mode, not mkdtemp's
        os.rename(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
        if full or any(m in str(e) for m in DISK_FULL):  # safetensors' writer words its io error its own way
            free = shutil.disk_usage(parent).free / 2**30
            raise OSError(f"hybridrl export: {parent} is full ({free:.1f} GiB free); nothing was written.") from e
        raise
    return out
