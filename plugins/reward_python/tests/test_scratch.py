"""Removing a call's scratch folder: at any depth, without following links, and never in silence."""

import os

import pytest
from hybridrl_reward_python.scratch import remove_tree


def nest(top, depth: int) -> None:
    """``depth`` folders, one in the other, each with a file: made through descriptors, as the path
    passes PATH_MAX long before the bottom."""
    fd = os.open(top, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
        inner = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)


def test_a_tree_3000_folders_deep_is_removed(tmp_path):
    top = tmp_path / "scratch"
    top.mkdir()
    nest(top, 3000)
    (top / "wide").mkdir()
    for i in range(50):
        (top / "wide" / str(i)).mkdir()
    remove_tree(str(top))
    assert not top.exists()


def test_links_are_removed_never_followed(tmp_path):
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "keep.txt").write_text("x")
    top = tmp_path / "scratch"
    top.mkdir()
    (top / "to_folder").symlink_to(outside)
    (top / "to_file").symlink_to(outside / "keep.txt")
    (top / "dangling").symlink_to(tmp_path / "nowhere")
    remove_tree(str(top))
    assert not top.exists() and (outside / "keep.txt").read_text() == "x" and (outside / "sub").is_dir()


@pytest.mark.skipif(os.getuid() == 0, reason="root reads and writes any folder")
def test_folders_made_unreadable_or_read_only_are_removed(tmp_path):
    top = tmp_path / "scratch"
    (top / "locked" / "in").mkdir(parents=True)
    (top / "read_only").mkdir()
    (top / "read_only" / "f").write_text("x")
    (top / "locked").chmod(0)
    (top / "read_only").chmod(0o500)
    remove_tree(str(top))
    assert not top.exists()


def test_what_cannot_be_removed_is_reported_naming_the_folder(tmp_path, monkeypatch):
    top = tmp_path / "scratch"
    (top / "sub").mkdir(parents=True)
    (top / "sub" / "stuck").write_text("x")
    (top / "gone").write_text("x")
    unlink = os.unlink

    def refuse(name, *, dir_fd=None):
        if name == "stuck":
            raise PermissionError(1, "Operation not permitted", name)
        unlink(name, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", refuse)
    with pytest.raises(OSError, match=rf"could not remove {top}: \[Errno 1\] Operation not permitted: 'stuck' \(and 1"):
        remove_tree(str(top))
    assert sorted(os.listdir(top)) == ["sub"]  # all else removed
    monkeypatch.undo()
    remove_tree(str(top))


def test_a_missing_folder_is_nothing_to_remove(tmp_path):
    remove_tree(str(tmp_path / "never made"))
