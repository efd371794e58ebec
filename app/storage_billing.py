"""StorageBilling: what tenants keep stored, charged by the hour at their tier's storage price (issue 35).

A tier's `price_storage_per_gb_day` prices each GB (10^9 bytes) of its tenants' live stored responses and
files a day. Once an hour has ended, the first run after it (every ingress runs one on the sweep timer)
samples each such tenant's stored bytes and records one usage row for that hour: model `storage`, no
tokens, its cost fixed at the price in force (bytes x price / 24 / 10^9, rounded to the micro-unit; under
half a micro-unit is no row). The row's request id is made of the tenant and the hour, so replicas racing
each other and later runs insert it once (usage rows are insert-or-ignore by request id). From there it is
usage like any other: the hourly rollups, bills, the Stripe cost meter, `GET /v1/usage` and a prepaid
tenant's credit count it. The run that inserted a row also spends it in the live budget (`spend`: the
budget backend's settle, idempotent per request id) before it commits, so a prepaid balance and the spend
limits see it at once, as a request's settle does, and a snapshot read meanwhile does not count it twice.

A sample an hour, not an integral: bytes stored and deleted within one hour between samples are not
charged, and an hour no ingress ran after (the platform was down) is not charged later.
"""

import logging
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal

import anyio.from_thread
from sqlalchemy import select
from sqlalchemy.orm import Session

from billing.models import STORAGE_MODEL, Tenant, TenantStatus, Tier, utcnow
from billing.repository import stored_bytes_by_tenant
from billing.usage import UsageRecord, hour_of, record_new_usage

log = logging.getLogger(__name__)
# What a charge is spent through: (tenant id, request id, cost) -> the live budget's settle.
Spend = Callable[[str, str, Decimal], Awaitable[None]]

MODEL = STORAGE_MODEL  # the usage rows' model and base model
GB = 10**9
MICRO = Decimal("0.000001")


def storage_request_id(tenant_id: str, hour: datetime) -> str:
    return f"storage-{tenant_id}-{hour_of(hour):%Y%m%d%H}"


class StorageBilling:
    def __init__(self, sessions: Callable[[], Session], spend: Spend | None = None) -> None:
        """`spend`: where a new charge is settled in the live budget; it is called from the charging
        thread through anyio, so `charge` then runs in a worker thread of the event loop
        (run_in_threadpool)."""
        self.sessions = sessions
        self.spend = spend
        # The last hour this instance charged: the timer's later rounds in that hour need no queries (another
        # replica's charge of it is found by the insert-or-ignore).
        self._charged: datetime | None = None

    def charge(self, now: datetime | None = None) -> int:
        """Charge the hour that ended last, for every active tenant of a tier with a storage price; returns
        how many rows were new (0 when another run charged the hour already). Blocking: run it in a thread."""
        now = now or utcnow()
        hour = hour_of(now) - timedelta(hours=1)
        if hour == self._charged:
            return 0
        with self.sessions() as s, s.begin():
            priced = s.execute(
                select(Tenant.id, Tier.price_storage_per_gb_day, Tier.currency)
                .join(Tier, Tenant.tier == Tier.name)
                .where(Tier.price_storage_per_gb_day > 0, Tenant.status == TenantStatus.ACTIVE.value)
            ).all()
            ids = [row[0] for row in priced]
            stored = stored_bytes_by_tenant(s, tenant_ids=ids, now=now) if ids else {}
            records = []
            for tenant_id, price, currency in priced:
                cost = (Decimal(stored.get(tenant_id, 0)) * Decimal(price) / (24 * GB)).quantize(
                    MICRO, ROUND_HALF_UP
                )
                if cost > 0:
                    records.append(_record(tenant_id, hour, cost, currency))
            new = record_new_usage(s, records)
            if self.spend is not None:
                for record in records:
                    if record.request_id in new:
                        anyio.from_thread.run(self._spend, record)
        self._charged = hour
        return len(new)

    async def _spend(self, record: UsageRecord) -> None:
        assert self.spend is not None and record.cost is not None
        try:
            await self.spend(record.tenant_id, record.request_id, Decimal(record.cost))
        except Exception as error:  # the backend is away: the row is in the ledger, which its next load reads
            log.warning("spending %s in the live budget failed: %s", record.request_id, error)


def _record(tenant_id: str, hour: datetime, cost: Decimal, currency: str) -> UsageRecord:
    return UsageRecord(
        request_id=storage_request_id(tenant_id, hour),
        tenant_id=tenant_id,
        key_id="",
        model=MODEL,
        base_model=MODEL,
        adapter_id=None,
        adapter_version=None,
        status="completed",
        finish_reason=None,
        prompt_tokens=0,
        cached_tokens=0,
        completion_tokens=0,
        gpu_ms=0.0,
        queue_ms=0.0,
        ttft_ms=None,
        latency_ms=0.0,
        replica=None,
        started_at=hour,
        finished_at=hour + timedelta(hours=1),
        cost=str(cost),
        currency=currency,
    )
