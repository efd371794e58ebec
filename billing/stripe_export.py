"""Stripe Billing Meters export: closed hourly rollups become meter events, each delivered exactly once.

Five meters sum per customer: four quantities (uncached input tokens, cached input tokens, output tokens,
GPU ms) and one amount of money, the rollup's settled cost in micro-units (the sum of its usage rows' costs,
each fixed at our prices when the request ran), so per-tenant, per-adapter and historical prices reach the
invoice. A tenant's usage from the hour it became prepaid (tenants.prepaid_since, its first credit granted)
on is paid from credit: money already collected, so none of its meters is sent (its rows are 'skipped', so
the log still accounts for it). For each closed rollup of a tenant with a Stripe customer, and each meter,
the export log (stripe_exports) holds one row per increase: revision r carries what that rollup's meter grew
by since the rows before it, under the identifier "<rollup id>-<meter key>-r<r>". A late event that lands in
an exported hour therefore becomes a new revision carrying just the increase; a rollup that did not grow
produces nothing.

Planning (rows created 'pending') and sending are separate, and each delivered event is committed on its own,
so a crash loses nothing: a row whose event Stripe got but whose commit was lost stays 'pending' and is sent
again under the same identifier. Stripe refuses a reused identifier (for at least 24 hours) with a 400; the
exporter counts that refusal as delivered. Rows whose event time is past Stripe's 35-day window are marked
'skipped' and never sent. reconcile() compares the database, the export log and Stripe's own summaries.

Stripe SDK calls (stripe 16.x, StripeClient):
    client.v1.billing.meter_events.create(params={"event_name", "payload", "identifier", "timestamp"})
    client.v1.billing.meters.list(params={"limit": 100}).auto_paging_iter()
    client.v1.billing.meters.event_summaries.list(meter_id, params={"customer", "start_time", "end_time"})
"""

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any, Final, NamedTuple

import stripe
from sqlalchemy import case, func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from billing.models import StripeExport, Tenant, UsageRollup, utcnow
from billing.stripe_config import StripeConfig
from billing.usage import closed_before, hour_of

log = logging.getLogger(__name__)

METER_KEYS: Final = ("input_tokens", "cached_input_tokens", "output_tokens", "gpu_ms", "cost")
# Stripe takes meter events whose timestamp is within the past 35 days. The margin keeps a row planned now
# from expiring before it is sent, and leaves room for clock drift.
STRIPE_MAX_EVENT_AGE: Final = timedelta(days=35)
SEND_MARGIN: Final = timedelta(hours=1)
EVENT_OFFSET: Final = timedelta(minutes=30)  # an event's time: the middle of its hour, never on a boundary
# Rows whose value counts as handled: delivered, on its way, or deliberately never sent. An operator may set
# a row to 'failed' to give its value back: the next run plans it again under a new revision.
ACCOUNTED: Final = ("sent", "pending", "skipped")
TOO_OLD = "event time is older than Stripe's 35-day window for meter events; not billed"
PREPAID = "prepaid: paid from the tenant's credit; not invoiced again"
_CHUNK = 500  # rollup ids per IN (...) list
_LOGGED: Final = ("sent", "skipped", "pending")


class ExportDisabled(RuntimeError):
    """No Stripe API key is configured (LORAPLEX_STRIPE_API_KEY)."""


@dataclass(frozen=True)
class ExportSummary:
    """One export run. `failed`: events tried this run and left pending (they are tried again next run)."""

    created: int  # pending rows planned this run
    sent: int  # events Stripe accepted this run (duplicates included)
    failed: int
    skipped: int  # rows marked skipped this run (too old to send)
    duplicates: int = 0  # of `sent`: events Stripe already had under that identifier
    pending: int = 0  # rows still pending after the run (failed, or beyond batch_limit)
    prepaid: int = 0  # rows marked skipped this run as prepaid usage (paid from credit)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class Discrepancy:
    """Totals of one customer's meter over a window that do not agree. `stripe` is None when not asked."""

    customer: str
    meter: str  # the Stripe meter's event_name
    db: int  # what the closed rollups add up to
    sent: int  # what the export log says Stripe accepted
    skipped: int  # what was deliberately never sent (too old, or prepaid)
    pending: int  # planned, not delivered yet
    stripe: int | None  # Stripe's meter event summary

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def meter_values(rollup: UsageRollup) -> dict[str, int]:
    """What a rollup's meters add up to: integers, as Stripe's meter event values must be."""
    return {
        "input_tokens": max(rollup.prompt_tokens - rollup.cached_tokens, 0),
        "cached_input_tokens": rollup.cached_tokens,
        "output_tokens": rollup.completion_tokens,
        "gpu_ms": round(rollup.gpu_ms),
        "cost": rollup.cost_micros or 0,  # NULL: a rollup not recomputed since 0008; its quantities were sent
    }


def identifier(rollup_id: str, meter_key: str, revision: int) -> str:
    """Deterministic, so a replay is deduplicated by Stripe; at most 27 + 1 + 19 + 2 + digits < 100 chars."""
    return f"{rollup_id}-{meter_key}-r{revision}"


def make_client(config: StripeConfig) -> stripe.StripeClient:
    if not config.enabled:
        raise ExportDisabled("Stripe export is disabled: LORAPLEX_STRIPE_API_KEY is empty")
    return stripe.StripeClient(
        config.api_key.get_secret_value(),
        base_addresses={"api": config.api_base.rstrip("/")} if config.api_base else None,
        max_network_retries=config.max_network_retries,
    )


def export_usage(
    session_factory: sessionmaker[Session],
    config: StripeConfig,
    *,
    client: stripe.StripeClient | None = None,
    now: datetime | None = None,
    retries: int = 3,
    backoff_s: float = 1.0,
    max_backoff_s: float = 30.0,
    sleep: Callable[[float], None] = time.sleep,
    on_progress: Callable[[int, int], None] | None = None,
) -> ExportSummary:
    """Plan what grew, then send up to config.batch_limit pending events, oldest first.

    Idempotent: a second run with no new usage sends nothing. Errors do not raise: the event stays pending
    (attempts and last_error updated) and is counted in `failed`. 429, 409, 5xx and connection errors are
    retried within the run, after the SDK's own retries, `retries` more times with exponential backoff from
    `backoff_s` (or the server's Retry-After), each wait at most `max_backoff_s`; if they persist, or the key
    is refused, the run stops there and the rest waits for the next run. Any other refusal (a 400) concerns
    one event: the run goes on. `on_progress(done, total)` is called after each event of the batch.
    """
    client = client or make_client(config)
    now = now or utcnow()
    created, skipped, prepaid = plan_exports(session_factory, config, now=now)
    sent = failed = duplicates = 0
    oldest = now - STRIPE_MAX_EVENT_AGE + SEND_MARGIN
    with session_factory() as session:
        batch = session.scalars(
            select(StripeExport)
            .where(StripeExport.status == "pending")
            .order_by(StripeExport.created_at, StripeExport.identifier)
            .limit(config.batch_limit)
        ).all()
    for done, row in enumerate(batch, start=1):
        if on_progress is not None:
            on_progress(done - 1, len(batch))
        if row.timestamp < oldest:  # waited too long (Stripe was away for weeks): never send it late
            _finish(session_factory, row.identifier, status="skipped", calls=0, error=TOO_OLD)
            skipped += 1
            continue
        delivery = _deliver(client, row, retries=retries, backoff_s=backoff_s, max_backoff_s=max_backoff_s,
                            sleep=sleep)  # fmt: skip
        if delivery.delivered:
            _finish(session_factory, row.identifier, status="sent", calls=delivery.calls, error=None)
            sent += 1
            duplicates += delivery.duplicate
            continue
        _finish(session_factory, row.identifier, status="pending", calls=delivery.calls, error=delivery.error)
        failed += 1
        log.warning("stripe export: %s not delivered: %s", row.identifier, delivery.error)
        if delivery.stop_run:  # every other event would fail the same way: leave them to the next run
            break
    if on_progress is not None:
        on_progress(len(batch), len(batch))
    with session_factory() as session:
        pending = session.scalar(select(func.count()).where(StripeExport.status == "pending")) or 0
    return ExportSummary(created=created, sent=sent, failed=failed, skipped=skipped, duplicates=duplicates,
                         pending=pending, prepaid=prepaid)  # fmt: skip


class Planned(NamedTuple):
    created: int  # pending rows
    skipped: int  # too old to send
    prepaid: int  # prepaid usage, never sent


def plan_exports(session_factory: sessionmaker[Session], config: StripeConfig, *, now: datetime) -> Planned:
    """Create an export row for every closed rollup meter that grew.

    A rollup whose event time is past Stripe's window, or that is prepaid usage, gets 'skipped' rows
    instead, so it is accounted once and not looked at again. Each chunk of rollups is committed on its
    own; a chunk that collides with a concurrent run (same deterministic identifiers) is rolled back and
    left to that run.
    """
    names = config.event_names()
    oldest = now - STRIPE_MAX_EVENT_AGE + SEND_MARGIN
    created = skipped = prepaid = 0
    with session_factory() as session:
        candidates = _grown_rollups(session, names, cutoff=closed_before(now))
    for start in range(0, len(candidates), _CHUNK):
        chunk = candidates[start : start + _CHUNK]
        with session_factory() as session:
            rows = _plan_chunk(session, chunk, names, oldest=oldest)
            pending = sum(row.status == "pending" for row in rows)
            session.add_all(rows)
            try:
                session.commit()
            except IntegrityError:
                session.rollback()
                log.warning("stripe export: another run planned the same rollups; leaving them to it")
                continue
        created += pending
        prepaid += sum(row.last_error == PREPAID for row in rows)
        skipped += sum(row.last_error == TOO_OLD for row in rows)
    return Planned(created, skipped, prepaid)


@dataclass(frozen=True)
class _Candidate:
    rollup: UsageRollup
    customer: str
    prepaid_since: datetime | None  # when the tenant's first credit was granted

    @property
    def prepaid(self) -> bool:
        """Usage from the hour the tenant became prepaid on is paid from credit (billing.credit counts it
        from the same hour): already paid. (The part of that hour before it is not invoiced either: never
        twice beats once too few.)"""
        since = self.prepaid_since
        return since is not None and self.rollup.hour >= hour_of(since)


def _grown_rollups(session: Session, names: Mapping[str, str], *, cutoff: datetime) -> list[_Candidate]:
    """Closed rollups of billed tenants where some meter may exceed what the export log accounts for.

    The filter runs in SQL so that a run reads only what changed; it is a superset for GPU ms (rounding
    is decided in Python, identically on both backends).
    """
    sums = (
        select(
            StripeExport.rollup_id,
            *(
                func.sum(case((StripeExport.meter == name, StripeExport.value), else_=0)).label(key)
                for key, name in names.items()
            ),
        )
        .where(StripeExport.status.in_(ACCOUNTED))
        .group_by(StripeExport.rollup_id)
        .subquery()
    )

    def accounted(key: str) -> Any:
        return func.coalesce(sums.c[key], 0)

    query = (
        select(UsageRollup, Tenant.stripe_customer_id, Tenant.prepaid_since)
        .join(Tenant, Tenant.id == UsageRollup.tenant_id)
        .outerjoin(sums, sums.c.rollup_id == UsageRollup.id)
        .where(UsageRollup.hour < cutoff)
        .where(Tenant.stripe_customer_id.is_not(None), Tenant.stripe_customer_id != "")
        .where(
            or_(
                UsageRollup.prompt_tokens - UsageRollup.cached_tokens > accounted("input_tokens"),
                UsageRollup.cached_tokens > accounted("cached_input_tokens"),
                UsageRollup.completion_tokens > accounted("output_tokens"),
                UsageRollup.gpu_ms >= accounted("gpu_ms") + 0.5,
                func.coalesce(UsageRollup.cost_micros, 0) > accounted("cost"),
            )
        )
        .order_by(UsageRollup.hour, UsageRollup.id)
    )
    rows = session.execute(query).tuples()
    return [_Candidate(rollup, customer, since) for rollup, customer, since in rows if customer]


def _plan_chunk(
    session: Session, chunk: Sequence[_Candidate], names: Mapping[str, str], *, oldest: datetime
) -> list[StripeExport]:
    ids = [c.rollup.id for c in chunk]
    existing = session.execute(
        select(StripeExport.rollup_id, StripeExport.identifier, StripeExport.meter, StripeExport.revision,
               StripeExport.value, StripeExport.status).where(StripeExport.rollup_id.in_(ids))
    ).all()  # fmt: skip
    accounted: dict[tuple[str, str], int] = defaultdict(int)
    revisions: dict[tuple[str, str], int] = defaultdict(int)
    taken: set[str] = set()
    for row in existing:
        taken.add(row.identifier)
        revisions[row.rollup_id, row.meter] = max(revisions[row.rollup_id, row.meter], row.revision)
        if row.status in ACCOUNTED:
            accounted[row.rollup_id, row.meter] += row.value
    planned: list[StripeExport] = []
    for candidate in chunk:
        rollup = candidate.rollup
        timestamp = rollup.hour + EVENT_OFFSET
        too_old = timestamp < oldest
        unsent = TOO_OLD if too_old else PREPAID if candidate.prepaid else None
        for key, desired in meter_values(rollup).items():
            meter = names[key]
            increase = desired - accounted[rollup.id, meter]
            if increase <= 0:  # a decrease is never sent back as a negative event; reconcile shows it
                continue
            revision = revisions[rollup.id, meter] + 1
            while identifier(rollup.id, key, revision) in taken:  # a meter renamed: its old rows keep theirs
                revision += 1
            planned.append(
                StripeExport(
                    identifier=identifier(rollup.id, key, revision),
                    rollup_id=rollup.id,
                    meter=meter,
                    revision=revision,
                    value=increase,
                    customer=candidate.customer,
                    timestamp=timestamp,
                    status="pending" if unsent is None else "skipped",
                    attempts=0,
                    last_error=unsent,
                )
            )
    return planned


@dataclass(frozen=True)
class _Delivery:
    delivered: bool
    calls: int
    error: str | None = None
    duplicate: bool = False
    stop_run: bool = False  # a bad key or permission, or Stripe still failing after every retry


def _deliver(
    client: stripe.StripeClient,
    row: StripeExport,
    *,
    retries: int,
    backoff_s: float,
    max_backoff_s: float,
    sleep: Callable[[float], None],
) -> _Delivery:
    calls = 0
    delay = backoff_s
    while True:
        calls += 1
        try:
            # Each call gets a fresh Idempotency-Key from the SDK (its own retries reuse it): a key reused
            # across our retries would replay a stored 500. The identifier is what deduplicates.
            client.v1.billing.meter_events.create(
                params={
                    "event_name": row.meter,
                    "payload": {"stripe_customer_id": row.customer, "value": str(row.value)},
                    "identifier": row.identifier,
                    "timestamp": int(row.timestamp.timestamp()),
                }
            )
            return _Delivery(delivered=True, calls=calls)
        except stripe.StripeError as error:
            if is_duplicate_identifier(error):  # Stripe has this event: an earlier attempt got through
                return _Delivery(delivered=True, calls=calls, duplicate=True)
            retryable = _retryable(error)
            if not retryable or calls > retries:
                # A retryable error that outlasted the retries means Stripe is down or throttling us: going on
                # would spend the whole backoff again on every event. A 400 concerns this event only.
                stop = retryable or isinstance(error, stripe.AuthenticationError | stripe.PermissionError)
                return _Delivery(delivered=False, calls=calls, error=_describe(error), stop_run=stop)
            retry_after = _retry_after(error)
            sleep(min(retry_after if retry_after is not None else delay, max_backoff_s))
            delay = min(delay * 2, max_backoff_s)


def is_duplicate_identifier(error: stripe.StripeError) -> bool:
    """Stripe's answer to a meter event whose identifier it already holds (a 400 invalid_request_error,
    message "An event already exists with identifier ..."). Matched on the code or, since Stripe does not
    document one for this case, on the message."""
    if not isinstance(error, stripe.InvalidRequestError):
        return False
    message = (error.user_message or str(error) or "").lower()
    return error.code == "resource_already_exists" or "already exists with identifier" in message


def _retryable(error: stripe.StripeError) -> bool:
    if isinstance(error, stripe.RateLimitError | stripe.APIConnectionError):
        return True
    status = error.http_status
    return status is not None and (status == 409 or status >= 500)


def _retry_after(error: stripe.StripeError) -> float | None:
    for name, value in (error.headers or {}).items():
        if name.lower() == "retry-after":
            try:
                return max(float(value), 0.0)
            except ValueError:  # an HTTP date: not worth parsing, the backoff applies
                return None
    return None


def _describe(error: stripe.StripeError) -> str:
    status = f"HTTP {error.http_status}" if error.http_status is not None else "no response"
    message = " ".join((error.user_message or str(error) or type(error).__name__).split())
    return f"{type(error).__name__} ({status}): {message}"[:1000]


def _finish(
    session_factory: sessionmaker[Session],
    identifier_: str,
    *,
    status: str,
    calls: int,
    error: str | None,
) -> None:
    """Record one row's outcome in its own transaction. Only a pending row changes: another run may have
    delivered it meanwhile, and its 'sent' must not be turned back into 'pending'."""
    values: dict[str, Any] = {
        "status": status,
        "attempts": StripeExport.attempts + calls,
        "last_error": error,
    }
    if status == "sent":
        values["sent_at"] = utcnow()
    with session_factory() as session, session.begin():
        session.execute(
            update(StripeExport)
            .where(StripeExport.identifier == identifier_, StripeExport.status == "pending")
            .values(**values)
        )


# --- reconciliation ------------------------------------------------------------------------------------


def reconcile(
    session: Session,
    *,
    start: datetime,
    end: datetime,
    config: StripeConfig | None = None,
    client: stripe.StripeClient | None = None,
    now: datetime | None = None,
) -> list[Discrepancy]:
    """Every customer and meter over the whole UTC hours [start, end) (closed hours only) whose totals
    disagree: the rollups vs the export log (sent + skipped), and, with a client, the log's sent vs Stripe's
    meter event summaries. Stripe aggregates asynchronously: right after an export its summaries may lag.
    """
    for name, moment in (("start", start), ("end", end)):
        if moment.tzinfo is None or hour_of(moment) != moment:
            raise ValueError(f"{name} must be an aware datetime on a whole UTC hour: {moment.isoformat()}")
    config = config or StripeConfig()
    end = min(end, closed_before(now or utcnow()))
    if end <= start:
        return []
    names = config.event_names()
    db = _db_totals(session, names, start=start, end=end)
    logged = _logged_totals(session, set(names.values()), start=start, end=end)
    customers = {customer for customer, _ in db} | {customer for customer, _, _ in logged}
    stripe_totals = None
    if client is not None:
        stripe_totals = _stripe_totals(client, customers, names.values(), start=start, end=end)
    found: list[Discrepancy] = []
    for customer in sorted(customers):
        for meter in names.values():
            sent, skipped, pending = (logged.get((customer, meter, s), 0) for s in _LOGGED)
            at_stripe = None if stripe_totals is None else stripe_totals.get((customer, meter), 0)
            total = db.get((customer, meter), 0)
            if total != sent + skipped or (at_stripe is not None and at_stripe != sent):
                found.append(Discrepancy(customer, meter, total, sent, skipped, pending, at_stripe))
    return found


def _db_totals(
    session: Session, names: Mapping[str, str], *, start: datetime, end: datetime
) -> dict[tuple[str, str], int]:
    totals: dict[tuple[str, str], int] = defaultdict(int)
    query = (
        select(UsageRollup, Tenant.stripe_customer_id)
        .join(Tenant, Tenant.id == UsageRollup.tenant_id)
        .where(UsageRollup.hour >= start, UsageRollup.hour < end)
        .where(Tenant.stripe_customer_id.is_not(None), Tenant.stripe_customer_id != "")
    )
    for rollup, customer in session.execute(query).tuples():
        if not customer:
            continue
        for key, value in meter_values(rollup).items():  # rounded per rollup, exactly as exported
            totals[customer, names[key]] += value
    return totals


def _logged_totals(
    session: Session, meters: set[str], *, start: datetime, end: datetime
) -> dict[tuple[str, str, str], int]:
    query = (
        select(StripeExport.customer, StripeExport.meter, StripeExport.status, func.sum(StripeExport.value))
        .where(StripeExport.timestamp >= start, StripeExport.timestamp < end, StripeExport.meter.in_(meters))
        .group_by(StripeExport.customer, StripeExport.meter, StripeExport.status)
    )
    return {(c, m, s): int(v or 0) for c, m, s, v in session.execute(query).tuples()}


def _stripe_totals(
    client: stripe.StripeClient,
    customers: Iterable[str],
    meters: Iterable[str],
    *,
    start: datetime,
    end: datetime,
) -> dict[tuple[str, str], int]:
    ids = meter_ids(client)
    totals: dict[tuple[str, str], int] = {}
    for meter in meters:
        meter_id = ids.get(meter)
        for customer in customers:
            if meter_id is None:  # no such meter at Stripe: nothing was counted there
                totals[customer, meter] = 0
                continue
            summaries = client.v1.billing.meters.event_summaries.list(
                meter_id,
                params={
                    "customer": customer,
                    "start_time": int(start.timestamp()),
                    "end_time": int(end.timestamp()),
                },
            )
            value = sum(summary.aggregated_value for summary in summaries.auto_paging_iter())
            totals[customer, meter] = round(value)
    return totals


def meter_ids(client: stripe.StripeClient) -> dict[str, str]:
    """event_name -> meter id of the account's meters; an active meter wins over a deactivated one."""
    ids: dict[str, str] = {}
    for meter in client.v1.billing.meters.list(params={"limit": 100}).auto_paging_iter():
        if meter.event_name not in ids or meter.status == "active":
            ids[meter.event_name] = meter.id
    return ids
