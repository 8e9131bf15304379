"""The python tool's scratch folders: made private for a call, and removed after it, whatever the
model's code left in them.

``shutil.rmtree`` of Python 3.11 recurses once per folder level, so code that nests a couple of
thousand folders makes it raise RecursionError (``ignore_errors`` passes over OSError only) and the
folder stays: megabytes a call, which a policy that learns the trick turns into a full disk. (Later
versions loop, but keep a descriptor open per level, which a deep enough tree runs out of.)
:func:`remove_tree` walks the tree in a loop, holding one open folder at a time: no recursion, no path
that grows with the depth (it works relative to folder descriptors), no descriptor per level. What it
cannot remove it reports, naming the folder; it never passes over it in silence.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


@contextlib.contextmanager
def scratch_folder(prefix: str, who: str):
    """A fresh folder (mode 0700) in the temporary folder for the ``with`` block, removed after it.
    A failure to remove it is printed as one warning naming ``who``, the folder and the cause."""
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        yield path
    finally:
        try:
            remove_tree(path)
        except OSError as e:
            print(f"warning: {who}: a call's scratch folder was left behind: {e}. Remove it by hand.", file=sys.stderr)


def remove_tree(path: str) -> None:
    """Removes the folder ``path`` and everything in it, at any depth; symlinks are removed, never followed.

    Folders the code made unreadable or unwritable are made the owner's again (mode 0700) on the way.
    Removes all it can, then raises one OSError naming ``path`` and the first failure if anything is left."""
    errors: list[OSError] = []
    try:
        fd = os.open(path, _DIR)
    except FileNotFoundError:
        return
    # one entry per level, from path down: (its name in its parent, its (device, inode), its folders left)
    levels = [("", _identity(fd), _empty(fd, errors))]
    try:
        while True:
            name, _, folders = levels[-1]
            if folders:
                inner = folders.pop()
                child = _enter(fd, inner, errors)
                if child is not None:
                    os.close(fd)
                    fd = child
                    levels.append((inner, _identity(fd), _empty(fd, errors)))
                continue
            if len(levels) == 1:
                break
            parent = os.open("..", _DIR, dir_fd=fd)
            if _identity(parent) != levels[-2][1]:  # nothing runs in it any more: this is not expected
                os.close(parent)
                errors.append(OSError(f"{name} moved while it was being removed"))
                break
            os.close(fd)
            fd = parent
            levels.pop()
            _attempt(errors, os.rmdir, name, dir_fd=fd)
    finally:
        os.close(fd)
    if not errors:
        _attempt(errors, os.rmdir, path)
    if errors:
        more = f" (and {len(errors) - 1} more failures)" if len(errors) > 1 else ""
        raise OSError(f"could not remove {path}: {errors[0]}{more}")


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _attempt(errors: list[OSError], fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except FileNotFoundError:
        pass
    except OSError as e:
        errors.append(e)


def _empty(fd: int, errors: list[OSError]) -> list[str]:
    """Removes the files and links in the folder ``fd``; the names of the folders in it."""
    if os.fstat(fd).st_mode & 0o700 != 0o700:  # a folder made read-only: its owner may write it again
        _attempt(errors, os.fchmod, fd, 0o700)
    folders = []
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        folders.append(entry.name)
                    else:
                        os.unlink(entry.name, dir_fd=fd)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    errors.append(e)
    except OSError as e:
        errors.append(e)
    return folders


def _enter(fd: int, name: str, errors: list[OSError]) -> int | None:
    """The folder ``name`` in ``fd``, opened without following a symlink; None (the failure noted) if it cannot be."""
    try:
        return os.open(name, _DIR, dir_fd=fd)
    except PermissionError:  # made unreadable (mode 000): its owner may open it again
        try:
            os.chmod(name, 0o700, dir_fd=fd)
            return os.open(name, _DIR, dir_fd=fd)
        except OSError as e:
            errors.append(e)
    except OSError as e:
        errors.append(e)
    return None
