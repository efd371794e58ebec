"""build_services: wire settings, database, catalog and an engine client into Services."""

import logging

from adapters.errors import AdapterStoreUnavailable
from adapters.store import AdapterStore, remove_stale
from app.auth.admin_auth import AdminAuth
from app.auth.authenticator import Authenticator
from app.auth.failures import FailureThrottle
from app.auth.key_usage import KeyUsageRecorder
from app.budgets.guard import BudgetGuard
from app.budgets.local_backend import LocalBudgets
from app.budgets.protocol import BudgetBackend
from app.limits import LimiterBackend
from app.limits.local_backend import LocalLimiter
from app.metering.database_sink import DatabaseSink
from app.metering.delivery import MeteringSink, UsageDelivery
from app.metering.observer import MeteringObserver
from app.metering.outbox import Outbox
from app.request_metrics import RequestMetrics
from app.served_models.adapter_resolver import AdapterResolver
from app.served_models.catalog import BaseModelSpec, ModelCatalog
from app.services import Services
from app.settings import Settings
from app.upload import UPLOADS_DIR
from billing import migrate
from billing.db import make_engine, make_session_factory
from billing.schema_gate import SchemaGate
from deployments.engine.interface import EngineClient

log = logging.getLogger(__name__)


def adapter_store(settings: Settings) -> AdapterStore:
    """The adapter store as this process sees it: an object store read through the configured node
    cache (never the per-user default under /tmp)."""
    return AdapterStore(
        settings.resolved_adapter_store(),
        cache_dir=settings.resolved_adapter_cache_dir(),
        cache_max_bytes=settings.adapter_cache_mb * 2**20,
    )


def build_services(
    settings: Settings,
    engine: EngineClient,
    models: dict[str, BaseModelSpec],
    *,
    limiter: LimiterBackend | None = None,
    limiter_fail_open: bool = False,
    metering: MeteringSink | None = None,
    budgets: BudgetBackend | None = None,
) -> Services:
    """`models`: the served base models by name. Without a limiter backend, limits are kept in this
        process (right for one ingress replica; the Serve deployment passes a cluster-wide one), and budgets
    likewise. Without a
        metering sink, usage goes from the outbox straight into the database."""
    url = settings.resolved_database_url()
    if settings.auto_migrate:
        migrate.upgrade_to_head(url)
    database = make_engine(url, settings.database_pool)
    # Every session first checks the schema is this code's: a database never migrated says so, clearly.
    session_factory = make_session_factory(database, check=SchemaGate(database).require)
    secret = settings.resolved_key_secret()
    outbox = Outbox(settings.data_dir / "outbox.sqlite")
    delivery = UsageDelivery(outbox, metering or DatabaseSink(session_factory))
    store = adapter_store(settings)
    # The ingress writes to the store: a store that would let two uploads overwrite each other is found
    # now, and said so in the log, instead of on the first upload.
    try:
        store.check_writes()
    except AdapterStoreUnavailable as error:  # asked again on the first upload
        log.warning("could not check the adapter store for uploads at start: %s", error)
    # What uploads killed mid-way left behind; nothing else ever removes it.
    store.cleanup_tmp(settings.leftover_max_age_s)
    remove_stale(settings.data_dir / UPLOADS_DIR, settings.leftover_max_age_s)
    return Services(
        settings=settings,
        key_secret=secret,
        session_factory=session_factory,
        authenticator=Authenticator(
            session_factory,
            secret,
            ttl=settings.auth_cache_ttl_s,
            failures=FailureThrottle(
                limit=settings.auth_failure_limit,
                per_key_limit=settings.auth_failure_limit_per_key,
                window_s=settings.auth_failure_window_s,
            ),
            key_usage=KeyUsageRecorder(session_factory, interval_s=settings.key_last_used_interval_s),
        ),
        admin_auth=AdminAuth(settings),
        catalog=ModelCatalog.from_specs(models),
        engine=engine,
        adapters=AdapterResolver(session_factory, ttl=settings.adapter_cache_ttl_s),
        store=store,
        limiter=limiter or LocalLimiter(),
        limiter_fail_open=limiter_fail_open,
        budget_guard=BudgetGuard(
            budgets or LocalBudgets(),
            session_factory,
            price_ttl_s=settings.auth_cache_ttl_s,
            max_gpu_seconds=settings.budget_max_gpu_seconds,
        ),
        delivery=delivery,
        observers=[MeteringObserver(outbox, delivery), RequestMetrics()],
    )
