"""Adapter registry queries: names per owner, immutable versions, soft deletion, tenant visibility.

Tenants name their own adapters plainly (`my-adapter`) and public ones as `public/<name>`: a plain name
never reaches another owner's adapter, so a private adapter of another tenant and a name that does not
exist look exactly the same.
"""

from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from adapters.errors import AdapterNotFound
from adapters.ref import AdapterRef
from adapters.registered_digest import RegisteredDigest
from billing.models import PUBLIC_OWNER, Adapter, AdapterVersion

PUBLIC_PREFIX = f"{PUBLIC_OWNER}/"


@dataclass(frozen=True)
class LiveAdapter:
    """An adapter that can serve, with its newest version."""

    adapter: Adapter
    latest: AdapterVersion

    def model_name_for(self, tenant_id: str) -> str:
        """How `tenant_id` names it in requests."""
        return self.adapter.name if self.adapter.owner == tenant_id else PUBLIC_PREFIX + self.adapter.name


def find_live(session: Session, *, owner: str, name: str) -> Adapter | None:
    query = select(Adapter).where(Adapter.owner == owner, Adapter.name == name, Adapter.deleted_at.is_(None))
    return session.scalars(query).first()


def create_adapter(session: Session, *, name: str, owner: str, base_model: str) -> Adapter:
    adapter = Adapter(name=name, owner=owner, base_model=base_model)
    session.add(adapter)
    session.flush()
    return adapter


def add_version(
    session: Session,
    *,
    adapter: Adapter,
    version: int,
    rank: int,
    target_modules: list[str],
    sha256: str,
    size_bytes: int,
) -> AdapterVersion:
    row = AdapterVersion(
        adapter_id=adapter.id,
        version=version,
        rank=rank,
        target_modules=sorted(target_modules),
        sha256=sha256,
        size_bytes=size_bytes,
    )
    session.add(row)
    adapter.updated_at = datetime.now(UTC)
    session.flush()
    return row


def get_adapter(session: Session, *, adapter_id: str) -> Adapter:
    adapter = session.get(Adapter, adapter_id)
    if adapter is None:
        raise AdapterNotFound(adapter_id)
    return adapter


def latest_version(session: Session, *, adapter_id: str) -> AdapterVersion | None:
    query = select(AdapterVersion).where(AdapterVersion.adapter_id == adapter_id)
    return session.scalars(query.order_by(AdapterVersion.version.desc())).first()


def registered_digest(session: Session, *, ref: AdapterRef) -> RegisteredDigest | None:
    """What was recorded of one version at upload (deleted adapters included: their rows stay)."""
    row = session.get(AdapterVersion, (ref.adapter_id, ref.version))
    return None if row is None else RegisteredDigest(row.sha256, row.size_bytes)


def list_versions(session: Session, *, adapter_id: str) -> list[AdapterVersion]:
    query = select(AdapterVersion).where(AdapterVersion.adapter_id == adapter_id)
    return list(session.scalars(query.order_by(AdapterVersion.version)))


def list_adapters(
    session: Session,
    *,
    owner: str | None = None,
    base_model: str | None = None,
    include_deleted: bool = False,
) -> list[LiveAdapter]:
    """Adapters with their newest version, oldest first."""
    newest = (
        select(AdapterVersion.adapter_id, func.max(AdapterVersion.version).label("version"))
        .group_by(AdapterVersion.adapter_id)
        .subquery()
    )
    query = (
        select(Adapter, AdapterVersion)
        .join(newest, newest.c.adapter_id == Adapter.id)
        .join(
            AdapterVersion,
            (AdapterVersion.adapter_id == newest.c.adapter_id) & (AdapterVersion.version == newest.c.version),
        )
        .order_by(Adapter.created_at, Adapter.id)
    )
    if owner is not None:
        query = query.where(Adapter.owner == owner)
    if base_model is not None:
        query = query.where(Adapter.base_model == base_model)
    if not include_deleted:
        query = query.where(Adapter.deleted_at.is_(None))
    return [LiveAdapter(row[0], row[1]) for row in session.execute(query)]


def visible_to(session: Session, *, tenant_id: str) -> list[LiveAdapter]:
    """The tenant's own adapters and the public ones."""
    return list_adapters(session, owner=tenant_id) + list_adapters(session, owner=PUBLIC_OWNER)


def resolve(session: Session, *, tenant_id: str, model: str) -> LiveAdapter | None:
    """`my-adapter` (own) or `public/<name>` -> the live adapter and its newest version, or None."""
    owner, name = (
        (PUBLIC_OWNER, model.removeprefix(PUBLIC_PREFIX))
        if model.startswith(PUBLIC_PREFIX)
        else (
            tenant_id,
            model,
        )
    )
    adapter = find_live(session, owner=owner, name=name)
    if adapter is None:
        return None
    latest = latest_version(session, adapter_id=adapter.id)
    return None if latest is None else LiveAdapter(adapter, latest)


def set_pinned(session: Session, *, adapter_id: str, pinned: bool) -> Adapter:
    adapter = _live(session, adapter_id)
    adapter.pinned = pinned
    adapter.updated_at = datetime.now(UTC)
    session.flush()
    return adapter


def delete_adapter(session: Session, *, adapter_id: str) -> Adapter:
    """Unservable from now on; rows stay for the usage history. Idempotent."""
    adapter = get_adapter(session, adapter_id=adapter_id)
    if adapter.deleted_at is None:
        adapter.deleted_at = adapter.updated_at = datetime.now(UTC)
        adapter.pinned = False
        session.flush()
    return adapter


def _live(session: Session, adapter_id: str) -> Adapter:
    adapter = get_adapter(session, adapter_id=adapter_id)
    if adapter.deleted_at is not None:
        raise AdapterNotFound(adapter_id)
    return adapter
