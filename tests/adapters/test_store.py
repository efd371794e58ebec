import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from adapters.errors import AdapterInvalid, AdapterNotFound
from adapters.ref import AdapterRef
from adapters.spec import CONFIG_FILE, WEIGHTS_FILE
from adapters.store import AdapterStore


@pytest.fixture
def src(tmp_path: Path) -> Path:
    """A stand-in adapter directory: the store copies bytes and never parses them."""
    path = tmp_path / "src"
    path.mkdir()
    (path / CONFIG_FILE).write_text('{"peft_type": "LORA"}')
    (path / WEIGHTS_FILE).write_bytes(os.urandom(4096))
    (path / "README.md").write_text("not copied")
    return path


@pytest.fixture
def store(tmp_path: Path) -> AdapterStore:
    return AdapterStore(tmp_path / "store")


def visible(store: AdapterStore) -> list[str]:
    return sorted(p.name for p in store.root.iterdir() if not p.name.startswith("."))


def test_versions_increment_from_one(store: AdapterStore, src: Path) -> None:
    assert store.versions("a") == []
    assert store.put_dir("a", src) == AdapterRef("a", 1)
    assert store.put_dir("a", src) == AdapterRef("a", 2)
    assert store.put_dir("b", src) == AdapterRef("b", 1)
    assert store.versions("a") == [1, 2]
    assert store.latest("a") == AdapterRef("a", 2)


def test_put_copies_exactly_the_two_files(store: AdapterStore, src: Path) -> None:
    path = store.path(store.put_dir("a", src))
    assert path == store.root / "a" / "v1"
    assert sorted(p.name for p in path.iterdir()) == sorted([CONFIG_FILE, WEIGHTS_FILE])
    assert (path / WEIGHTS_FILE).read_bytes() == (src / WEIGHTS_FILE).read_bytes()
    assert list((store.root / ".tmp").iterdir()) == []


def test_put_requires_both_files(store: AdapterStore, src: Path) -> None:
    (src / WEIGHTS_FILE).unlink()
    with pytest.raises(AdapterInvalid, match=f"missing {WEIGHTS_FILE}"):
        store.put_dir("a", src)
    assert visible(store) == []


def test_put_refuses_symlinked_files(store: AdapterStore, src: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("host file")
    (src / CONFIG_FILE).unlink()
    (src / CONFIG_FILE).symlink_to(secret)
    with pytest.raises(AdapterInvalid, match="must not be a symlink"):
        store.put_dir("a", src)


def test_concurrent_puts_get_distinct_versions(store: AdapterStore, src: Path) -> None:
    writers = 16
    barrier = threading.Barrier(writers)

    def put(_: int) -> AdapterRef:
        barrier.wait()  # maximise the race on the same next version
        return store.put_dir("race", src)

    with ThreadPoolExecutor(writers) as pool:
        refs = list(pool.map(put, range(writers)))
    assert sorted(ref.version for ref in refs) == list(range(1, writers + 1))
    assert store.versions("race") == list(range(1, writers + 1))
    for ref in refs:
        assert (store.path(ref) / WEIGHTS_FILE).read_bytes() == (src / WEIGHTS_FILE).read_bytes()


def test_writer_that_loses_the_rename_retries_with_the_next_version(
    store: AdapterStore, src: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.put_dir("a", src)
    real_rename = os.rename

    def rename_after_a_rival(source: str | Path, target: str | Path) -> None:
        if Path(target).name == "v2" and not (store.root / "a" / "v2").exists():
            shutil.copytree(store.path(AdapterRef("a", 1)), store.root / "a" / "v2")  # the rival wins
        real_rename(source, target)

    monkeypatch.setattr(os, "rename", rename_after_a_rival)
    assert store.put_dir("a", src) == AdapterRef("a", 3)


def test_failure_mid_put_leaves_no_visible_version(
    store: AdapterStore, src: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_fsync = os.fsync
    calls = 0

    def failing_fsync(fd: int) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:  # after the first file, before the second is durable
            raise OSError("disk on fire")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="disk on fire"):
        store.put_dir("a", src)
    assert store.versions("a") == []
    assert not store.exists(AdapterRef("a", 1))
    assert list((store.root / ".tmp").iterdir()) == []
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert store.put_dir("a", src) == AdapterRef("a", 1)


def test_crash_leftovers_are_invisible_and_cleaned(store: AdapterStore, src: Path) -> None:
    leftover = store.root / ".tmp" / "deadbeef"
    leftover.mkdir()
    (leftover / CONFIG_FILE).write_text("{}")
    old = time.time() - 3600
    for path in (leftover / CONFIG_FILE, leftover):  # nothing inside written lately either
        os.utime(path, (old, old))
    fresh = store.root / ".tmp" / "inprogress"
    fresh.mkdir()
    assert store.put_dir("a", src).version == 1
    assert store.cleanup_tmp(max_age_s=600) == 1
    assert not leftover.exists()
    assert fresh.exists()


def test_path_and_exists(store: AdapterStore, src: Path) -> None:
    ref = store.put_dir("a", src)
    assert store.exists(ref)
    assert not store.exists(AdapterRef("a", 2))
    assert not store.exists(AdapterRef("a", 0))
    with pytest.raises(AdapterNotFound):
        store.path(AdapterRef("nope", 1))
    with pytest.raises(AdapterNotFound):
        store.latest("nope")


def test_delete_removes_every_version(store: AdapterStore, src: Path) -> None:
    store.put_dir("a", src)
    store.put_dir("a", src)
    store.put_dir("b", src)
    store.delete("a")
    assert store.versions("a") == []
    assert visible(store) == ["b"]
    assert list((store.root / ".trash").iterdir()) == []
    with pytest.raises(AdapterNotFound):
        store.delete("a")


def test_delete_version_never_reuses_the_number(store: AdapterStore, src: Path) -> None:
    store.put_dir("a", src)
    v2 = store.put_dir("a", src)
    store.delete_version(v2)
    assert store.versions("a") == [1]
    assert not store.exists(v2)
    assert store.latest("a") == AdapterRef("a", 1)
    assert store.put_dir("a", src) == AdapterRef("a", 3)  # a cached v2 must never meet different bytes
    with pytest.raises(AdapterNotFound):
        store.delete_version(v2)


@pytest.mark.parametrize(
    "adapter_id",
    [
        "",
        ".",
        "..",
        "../x",
        "a/b",
        "/abs",
        ".hidden",
        "-dash",
        "a b",
        "x" * 129,
        "ü",
        ".tmp",
        ".trash",
        "a\x00",
    ],
)
def test_invalid_ids_are_refused(store: AdapterStore, src: Path, adapter_id: str) -> None:
    with pytest.raises(AdapterInvalid, match="invalid adapter id"):
        store.put_dir(adapter_id, src)
    with pytest.raises(AdapterInvalid, match="invalid adapter id"):
        store.versions(adapter_id)
    with pytest.raises(AdapterInvalid, match="invalid adapter id"):
        store.delete(adapter_id)
    with pytest.raises(AdapterInvalid, match="invalid adapter id"):
        store.path(AdapterRef(adapter_id, 1))
    assert visible(store) == []


@pytest.mark.parametrize("adapter_id", ["a", "A.b_c-9", "0", "x" * 128, "org.team.sql-v2"])
def test_valid_ids(store: AdapterStore, src: Path, adapter_id: str) -> None:
    assert store.put_dir(adapter_id, src) == AdapterRef(adapter_id, 1)


def test_store_and_spec_import_without_the_model_stack() -> None:
    # The registry and API process use these; loading torch/transformers there would cost seconds and memory.
    heavy = "{'torch', 'transformers', 'peft'}"
    code = f"import sys, adapters.store, adapters.spec; print(sorted({heavy} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_everything_in_the_store_is_owner_only(tmp_path: Path, src: Path) -> None:
    previous = os.umask(0o022)  # permissive: modes must come from creation, not the umask
    try:
        store = AdapterStore(tmp_path / "store")
        ref = store.put_dir("a1", src)
        store.put_dir("a1", src)
        store.delete_version(ref)
    finally:
        os.umask(previous)
    paths = [store.root, *store.root.rglob("*")]
    modes = {p.relative_to(store.root).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in paths}
    assert modes == {
        ".": 0o700,
        ".tmp": 0o700,
        ".trash": 0o700,
        "a1": 0o700,
        "a1/v2": 0o700,
        f"a1/v2/{CONFIG_FILE}": 0o600,
        f"a1/v2/{WEIGHTS_FILE}": 0o600,
        "a1/v1.deleted": 0o600,
    }


def test_a_staging_dir_still_being_written_is_not_swept(store: AdapterStore) -> None:
    """A long copy appends to a file without touching its directory: the newest mtime inside counts."""
    staging = store.root / ".tmp" / "busy"
    staging.mkdir()
    (staging / WEIGHTS_FILE).write_bytes(b"x")
    old = time.time() - 7200
    os.utime(staging, (old, old))
    assert store.cleanup_tmp(max_age_s=600) == 0
    assert staging.exists()
    os.utime(staging / WEIGHTS_FILE, (old, old))
    assert store.cleanup_tmp(max_age_s=600) == 1
    assert not staging.exists()
