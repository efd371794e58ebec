"""The storage quota under concurrent uploads (app/files/store.py) and responses in flight (their storage
holds, app/responses/store.py) on each database: writes that each fit alone but not together never pass the
tenant's quota, and a refused upload leaves neither row nor bytes."""

import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.files.blobs import FileBlobs
from app.files.store import FileStore, QuotaExceeded
from app.responses.store import ResponseStore
from app.settings import ResponsesConfig
from billing import repository as repo
from billing.models import utcnow

UPLOADS = 8
SIZE = 40
QUOTA = 100  # room for two


def test_concurrent_uploads_stay_within_the_storage_quota(
    session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    with session_factory() as s, s.begin():
        tenant_id = repo.create_tenant(s, name="uploader").id
    store = FileStore(session_factory, FileBlobs(tmp_path / "store"))
    source = tmp_path / "upload.jsonl"
    source.write_bytes(b"x" * (SIZE - 1) + b"\n")
    start = threading.Barrier(UPLOADS)
    outcomes: list[str] = []
    refusals: list[QuotaExceeded] = []

    def upload() -> None:
        start.wait()
        try:
            store.create(tenant_id, purpose="batch", filename="f.jsonl", source=source, size=SIZE, lines=1,
                         expires_at=utcnow() + timedelta(days=1), quota=QUOTA)  # fmt: skip
            outcomes.append("stored")
        except QuotaExceeded as full:
            refusals.append(full)
            outcomes.append("refused")

    threads = [threading.Thread(target=upload) for _ in range(UPLOADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(outcomes) == ["refused"] * (UPLOADS - 2) + ["stored"] * 2
    assert all(full.quota == QUOTA and full.needed == SIZE and full.used == 2 * SIZE for full in refusals)
    assert store.stored_bytes(tenant_id) == 2 * SIZE
    blobs = [p for p in (tmp_path / "store").rglob("*") if p.is_file()]
    assert len(blobs) == 2  # a refused upload's bytes went again


def test_concurrent_response_holds_and_uploads_share_the_quota(
    session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    """Responses in flight hold what they may store (ResponseStore.hold), under the same tenant lock as
    uploads: holds and uploads racing each other never commit past the quota together; a stored response
    turns its hold into its row, and a released hold frees its room."""
    with session_factory() as s, s.begin():
        tenant_id = repo.create_tenant(s, name="holder").id
    files = FileStore(session_factory, FileBlobs(tmp_path / "store"))
    responses = ResponseStore(session_factory, ResponsesConfig())
    source = tmp_path / "upload.jsonl"
    source.write_bytes(b"x" * (SIZE - 1) + b"\n")
    start = threading.Barrier(UPLOADS)
    held: list[str] = []
    outcomes: list[str] = []

    def hold(n: int) -> None:
        start.wait()
        if responses.hold(tenant_id, f"resp_{n}", SIZE, QUOTA) is None:
            held.append(f"resp_{n}")
            outcomes.append("held")
        else:
            outcomes.append("refused")

    def upload(n: int) -> None:
        start.wait()
        try:
            files.create(tenant_id, purpose="batch", filename="f.jsonl", source=source, size=SIZE, lines=1,
                         expires_at=utcnow() + timedelta(days=1), quota=QUOTA)  # fmt: skip
            outcomes.append("stored")
        except QuotaExceeded:
            outcomes.append("refused")

    threads = [threading.Thread(target=hold if n % 2 else upload, args=(n,)) for n in range(UPLOADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(outcomes) == UPLOADS and outcomes.count("refused") == UPLOADS - 2, outcomes
    with session_factory() as s:
        assert repo.committed_bytes(s, tenant_id=tenant_id, now=utcnow()) == 2 * SIZE
    for response_id in held:  # one is stored (its row counts instead of its hold), the others released
        if response_id == held[0]:
            row: dict[str, Any] = {"id": response_id, "model": "m", "previous_response_id": None}
            responses.save(tenant_id, {**row, "output": []}, [], [])
        else:
            responses.release(response_id)
    with session_factory() as s:
        assert repo.held_bytes(s, tenant_id=tenant_id, now=utcnow()) == 0
        stored = responses.stored_bytes(tenant_id) if held else 0
        assert (
            repo.committed_bytes(s, tenant_id=tenant_id, now=utcnow())
            == files.stored_bytes(tenant_id) + stored
        )
