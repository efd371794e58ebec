"""Services: everything a route needs, built once per ingress replica and held on app.state."""

from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy.orm import Session

from adapters.ref import AdapterRef
from adapters.store import AdapterStore
from app.auth.admin_auth import AdminAuth
from app.auth.authenticator import Authenticator, Principal
from app.budgets.guard import BudgetGuard
from app.errors import ModelNotFound
from app.files.blobs import FileBlobs
from app.files.store import FileStore
from app.limits import LimiterBackend
from app.limits.refusal_cache import RefusalCache
from app.metering.delivery import UsageDelivery
from app.metering.request_record import RequestObserver
from app.served_models.adapter_resolver import AdapterResolver
from app.served_models.catalog import BaseModelEntry, ModelCatalog
from app.settings import Settings
from deployments.engine.interface import EngineClient


@dataclass(frozen=True)
class Target:
    """What a request's `model` resolved to."""

    name: str
    base: BaseModelEntry
    adapter: AdapterRef | None


@dataclass
class Services:
    settings: Settings
    key_secret: bytes  # keys' HMAC secret, resolved once
    session_factory: Callable[[], Session]
    authenticator: Authenticator
    admin_auth: AdminAuth
    catalog: ModelCatalog
    engine: EngineClient
    adapters: AdapterResolver
    store: AdapterStore
    limiter: LimiterBackend
    delivery: UsageDelivery
    limiter_fail_open: bool = False
    budget_guard: BudgetGuard | None = None  # money at admission (issue 29); None: requests are not priced
    observers: list[RequestObserver] = field(default_factory=list)
    # Requests-per-minute refusals kept for a moment, so a refused flood is answered before its body is
    # parsed and without a limiter call each (issue 35); this process's own.
    refusals: RefusalCache = field(default_factory=RefusalCache)
    _files: FileStore | None = field(default=None, repr=False)

    def file_store(self) -> FileStore:
        """The Files API's store, made on first use: its bytes beside the adapters (in their store's
        backend), its rows in the platform database."""
        if self._files is None:
            self._files = FileStore(self.session_factory, FileBlobs(self.settings.resolved_adapter_store()))
        return self._files

    async def resolve(self, principal: Principal, model: str) -> Target:
        base = self.catalog.get(model)
        if base is not None:
            return Target(model, base, None)
        found = await self.adapters.resolve(principal, model)
        if found is None:
            raise ModelNotFound(model)
        base_name, ref = found
        entry = self.catalog.get(base_name)
        if entry is None:  # registered for a base model this deployment does not serve
            raise ModelNotFound(model)
        return Target(model, entry, ref)
