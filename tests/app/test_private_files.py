"""Files nobody else may read (the billing database, the outbox, secrets) are owner-only from creation, and
what uploads killed mid-way left behind is swept when the ingress starts."""

import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from app.bootstrap import build_services
from app.cli.run import _admin_key
from app.metering.outbox import Outbox
from app.private_files import write_secret
from app.settings import Settings
from app.upload import UPLOADS_DIR
from billing.db import make_engine
from deployments.engine.interface import LocalEngineClient


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(autouse=True)
def permissive_umask(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """umask 022, and no chmod: a mode fixed after creation leaves a window in which others can read."""
    monkeypatch.setattr(Path, "chmod", lambda self, mode, **kwargs: None)
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


def test_the_billing_database_and_its_wal_are_owner_only(tmp_path: Path) -> None:
    database = tmp_path / "data" / "loraplex.db"
    engine = make_engine(f"sqlite:///{database}")
    with engine.begin() as connection:
        connection.execute(text("CREATE TABLE t (x INTEGER)"))
        connection.execute(text("INSERT INTO t VALUES (1)"))
        wal = [p for p in tmp_path.joinpath("data").iterdir() if p.name.endswith(("-wal", "-shm"))]
        assert wal, "WAL mode keeps -wal/-shm files while connected"
        assert {p.name: mode(p) for p in [database, *wal]} == {p.name: 0o600 for p in [database, *wal]}
    engine.dispose()


def test_the_outbox_is_owner_only(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "outbox.sqlite")
    try:
        assert mode(tmp_path / "outbox.sqlite") == 0o600
    finally:
        outbox.close()


def test_the_key_secret_is_owner_only(tmp_path: Path) -> None:
    secret = Settings(data_dir=tmp_path).resolved_key_secret()
    assert mode(tmp_path / "key_secret") == 0o600
    assert Settings(data_dir=tmp_path).resolved_key_secret() == secret
    assert [p.name for p in tmp_path.iterdir()] == ["key_secret"]


def test_the_admin_key_file_is_owner_only(tmp_path: Path) -> None:
    key, generated = _admin_key(Settings(data_dir=tmp_path, admin_key=""))
    assert generated and mode(tmp_path / "admin_key") == 0o600
    assert _admin_key(Settings(data_dir=tmp_path, admin_key="")) == (key, False)


def test_a_secret_is_never_written_through_an_existing_file_or_link(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("someone else's")
    (tmp_path / "secret").symlink_to(elsewhere)
    assert write_secret(tmp_path / "secret", "s3cret") is False
    assert elsewhere.read_text() == "someone else's"


def test_leftovers_of_killed_uploads_are_swept_at_startup(tmp_path: Path) -> None:
    """A killed upload's temp dir and store staging go at the next start; an upload in progress stays."""
    settings = Settings(data_dir=tmp_path, database_url=f"sqlite:///{tmp_path / 'db.sqlite'}")
    store_tmp = Path(settings.resolved_adapter_store()) / ".tmp"
    uploads = tmp_path / UPLOADS_DIR
    old = time.time() - settings.leftover_max_age_s - 60
    leftovers: list[Path] = []
    in_progress: list[Path] = []
    for scratch in (store_tmp, uploads):
        for name, bucket in (("killed", leftovers), ("busy", in_progress)):
            entry = scratch / name
            entry.mkdir(parents=True)
            (entry / "part-file").write_bytes(b"x")
            bucket.append(entry)
        # The busy one's directory is old too: only the file still being appended to is recent.
        for path in (scratch / "killed" / "part-file", scratch / "killed", scratch / "busy"):
            os.utime(path, (old, old))
    build_services(settings, LocalEngineClient({}), {})
    assert [p for p in leftovers if p.exists()] == []
    assert [p for p in in_progress if not p.exists()] == []


@pytest.mark.parametrize("which", ["admin_key", "key_secret"])
def test_a_secret_interrupted_mid_write_is_never_left_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    """A crash before the secret is on disk must not leave an empty or partial file under its real name:
    the next start would read it (an empty admin key disables the admin API for good)."""

    def crash(fd: int) -> None:
        raise OSError("killed mid-write")

    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", crash)
    settings = Settings(data_dir=tmp_path, admin_key="")
    with pytest.raises(OSError, match="killed mid-write"):
        _admin_key(settings) if which == "admin_key" else settings.resolved_key_secret()
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(os, "fsync", real_fsync)  # the next start
    if which == "admin_key":
        key, generated = _admin_key(settings)
        assert generated and key.startswith("lp-admin-")
    else:
        assert settings.resolved_key_secret()
    assert mode(tmp_path / which) == 0o600
