"""The storage quota under concurrent uploads (app/files/store.py) on each database: uploads that each fit
alone but not together never pass the tenant's quota, and a refused one leaves neither row nor bytes."""

import threading
from datetime import timedelta
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from app.files.blobs import FileBlobs
from app.files.store import FileStore, QuotaExceeded
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
