"""The node cache's directory is ours alone: a link, another user's directory or one others may write is
refused before anything in it is used or cleaned up, and cleanup never follows a link. Its default
location is a predictable path under /tmp, where anyone can plant one."""

import logging
import os
import stat
from pathlib import Path

import pytest

from adapters.directory_store import remove_stale
from adapters.node_cache import NodeCache
from adapters.private_dir import UnsafeDirectory


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A directory of ours that a planted link points at: it must survive whatever the cache does."""
    directory = tmp_path / "precious"
    (directory / "sub").mkdir(parents=True)
    (directory / "data.db").write_text("rows")
    (directory / "sub" / "more").write_text("rows")
    return directory


def intact(victim: Path) -> bool:
    return (victim / "data.db").read_text() == "rows" and (victim / "sub" / "more").read_text() == "rows"


def test_a_trash_folder_planted_as_a_link_is_refused_and_its_target_survives(
    tmp_path: Path, victim: Path
) -> None:
    """The verified attack: startup's `.trash` cleanup emptied the directory the link named."""
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    (root / ".trash").symlink_to(victim)
    with pytest.raises(UnsafeDirectory, match=r"\.trash: it is a symbolic link"):
        NodeCache(root)
    assert intact(victim)


def test_a_cache_dir_planted_as_a_link_is_refused(tmp_path: Path, victim: Path) -> None:
    (victim / ".trash").mkdir()
    (victim / ".trash" / "old").write_text("rows")
    root = tmp_path / "cache"
    root.symlink_to(victim)
    with pytest.raises(UnsafeDirectory, match="symbolic link"):
        NodeCache(root)
    assert intact(victim) and (victim / ".trash" / "old").exists()
    assert sorted(p.name for p in victim.iterdir()) == [".trash", "data.db", "sub"]  # nothing made in it


def test_another_users_dir_or_one_others_may_write_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    root.chmod(0o777)
    with pytest.raises(UnsafeDirectory, match="others may write in it"):
        NodeCache(root)
    root.chmod(0o700)
    (root / ".locks").mkdir(mode=0o700)
    (root / ".locks").chmod(0o770)
    with pytest.raises(UnsafeDirectory, match=r"\.locks: others may write"):
        NodeCache(root)
    (root / ".locks").chmod(0o700)
    if os.geteuid() == 0:  # only root can give a directory away
        os.chown(root, 65534, 65534)
        with pytest.raises(UnsafeDirectory, match="belongs to uid 65534"):
            NodeCache(root)
        os.chown(root, 0, 0)
    NodeCache(root)


def test_a_dir_others_may_only_read_is_made_private_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(0o755)  # as `mkdir -p` by an operator leaves it
    with caplog.at_level(logging.WARNING):
        NodeCache(root)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert "readable by others" in caplog.text
    for name in (".tmp", ".locks", ".trash", ".configs"):
        info = (root / name).lstat()
        assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700


def test_a_parent_others_may_write_is_refused_unless_sticky(tmp_path: Path) -> None:
    """Whoever may write in the parent can rename our directory away and put theirs in its place."""
    parent = tmp_path / "shared"
    parent.mkdir()
    parent.chmod(0o777)
    with pytest.raises(UnsafeDirectory, match="others may write in its parent"):
        NodeCache(parent / "cache")
    parent.chmod(0o1777)  # as /tmp: only an entry's owner may rename it
    NodeCache(parent / "cache")


def test_cleanup_removes_links_never_what_they_name(tmp_path: Path, victim: Path) -> None:
    leftovers = tmp_path / "tmp"
    leftovers.mkdir()
    (leftovers / "dir-link").symlink_to(victim)
    (leftovers / "file-link").symlink_to(victim / "data.db")
    (leftovers / "half").mkdir()
    (leftovers / "half" / "inner-link").symlink_to(victim)
    assert remove_stale(leftovers, 0) == 3
    assert list(leftovers.iterdir()) == [] and intact(victim)
    planted = tmp_path / "planted"
    planted.symlink_to(victim)
    assert remove_stale(planted, 0) == 0  # a link in the directory's own place is not cleaned through
    assert intact(victim)
