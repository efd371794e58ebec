"""AdapterIngest: an uploaded adapter from form fields and files to a served, versioned registry entry.

Order matters for "nothing half-written": everything is validated first (fields, archive safety, PEFT
config, every tensor against the base model); then the files go to the store (atomic rename); then the
registry row is committed. If the commit fails the stored version is removed again; if the process dies
in between, the store holds an unreferenced version and the registry never points at missing files.
"""

import hashlib
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from adapters.archive import extract_adapter_archive
from adapters.ref import AdapterRef
from adapters.spec import CONFIG_FILE, WEIGHTS_FILE
from adapters.store import AdapterStore
from adapters.validation import validate_adapter_dir
from app.errors import InvalidParameter
from app.served_models.catalog import BaseModelEntry, ModelCatalog
from app.upload import Upload
from billing import adapter_registry, repository
from billing.models import PUBLIC_OWNER, Adapter

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
FILE_FIELDS = {"file", "adapter_config", "adapter_model"}


@dataclass(frozen=True)
class _Facts:
    rank: int
    targets: list[str]
    sha256: str
    size: int


@dataclass(frozen=True)
class Ingested:
    adapter: Adapter
    ref: AdapterRef


class AdapterIngest:
    def __init__(self, catalog: ModelCatalog, store: AdapterStore, sessions: Callable[[], Session]) -> None:
        self._catalog = catalog
        self._store = store
        self._sessions = sessions

    def ingest(self, upload: Upload) -> Ingested:
        """Blocking (hashing, tensor checks, disk): run it in a thread."""
        name, owner, base = self._check_fields(upload)
        return self.register_dir(name, owner, base, self._adapter_dir(upload))

    def register_dir(self, name: str, owner: str, base: BaseModelEntry, directory: Path) -> Ingested:
        """Validate a PEFT adapter directory against `base` and register it as the next version."""
        spec = validate_adapter_dir(directory, base.layout, max_rank=base.spec.max_lora_rank)
        weights = directory / WEIGHTS_FILE
        facts = _Facts(
            rank=spec.max_rank,
            targets=list(spec.target_modules),
            sha256=_sha256(weights),
            size=weights.stat().st_size + (directory / CONFIG_FILE).stat().st_size,
        )
        try:
            return self._register((name, owner, base.name), directory, facts)
        except IntegrityError:  # a concurrent first upload of the same name won the insert: join it
            return self._register((name, owner, base.name), directory, facts)

    def _check_fields(self, upload: Upload) -> tuple[str, str, BaseModelEntry]:
        name = upload.fields.get("name", "").strip()
        owner = upload.fields.get("owner", "").strip()
        base_name = upload.fields.get("base_model", "").strip() or self._catalog.only()
        if not NAME_RE.match(name):
            message = "name must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
            raise InvalidParameter(message, param="name")
        if self._catalog.get(name) is not None:
            raise InvalidParameter(f"name {name!r} is a base model's name; choose another", param="name")
        if not owner:
            raise InvalidParameter('owner is required: a tenant id, or "public"', param="owner")
        if base_name is None:
            raise InvalidParameter(
                f"base_model is required: one of {self._catalog.names()}", param="base_model"
            )
        base = self._catalog.get(base_name)
        if base is None:
            message = f"base_model {base_name!r} is not served here; served: {self._catalog.names()}"
            raise InvalidParameter(message, param="base_model")
        if owner != PUBLIC_OWNER:
            with self._session() as session:
                tenant = repository.get_tenant(session, tenant_id=owner)  # TenantNotFound -> 404
                if tenant.status != "active":
                    raise InvalidParameter(f"tenant {owner} is disabled", param="owner")
        return name, owner, base

    def _adapter_dir(self, upload: Upload) -> Path:
        files = upload.files
        if "file" in files and not ({"adapter_config", "adapter_model"} & files.keys()):
            archive = files["file"]
            return extract_adapter_archive(
                archive.path, upload.directory / "extracted", filename=archive.filename
            )
        if {"adapter_config", "adapter_model"} <= files.keys() and "file" not in files:
            directory = upload.directory / "adapter"
            directory.mkdir()
            shutil.move(files["adapter_config"].path, directory / CONFIG_FILE)
            shutil.move(files["adapter_model"].path, directory / WEIGHTS_FILE)
            return directory
        message = (
            "send either `file` (a .tar.gz, .tgz or .zip of a PEFT adapter directory) "
            "or both `adapter_config` and `adapter_model`"
        )
        raise InvalidParameter(message, param="file", code="missing_files")

    def _register(self, fields: tuple[str, str, str], directory: Path, facts: "_Facts") -> Ingested:
        name, owner, base_model = fields
        ref: AdapterRef | None = None
        try:
            with self._session() as session, session.begin():
                adapter = adapter_registry.find_live(session, owner=owner, name=name)
                if adapter is None:
                    adapter = adapter_registry.create_adapter(
                        session, name=name, owner=owner, base_model=base_model
                    )
                elif adapter.base_model != base_model:
                    message = (
                        f"{name!r} was uploaded for base model {adapter.base_model!r}; "
                        "a new version must be for the same base model"
                    )
                    raise InvalidParameter(message, param="base_model")
                ref = self._store.put_dir(adapter.id, directory)
                adapter_registry.add_version(
                    session,
                    adapter=adapter,
                    version=ref.version,
                    rank=facts.rank,
                    target_modules=facts.targets,
                    sha256=facts.sha256,
                    size_bytes=facts.size,
                )
        except BaseException:
            if ref is not None:  # stored but not registered: take the files back out
                self._store.delete_version(ref)
            raise
        return Ingested(adapter, ref)

    def _session(self) -> Session:
        return self._sessions()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
