"""MeteringObserver: every finished request becomes one usage record in the outbox (then the database).

Completed, aborted and failed requests alike: the engine's usage rides on every output, so a request whose
client went away is billed for what the engine had processed up to the last output the ingress received.
"""

from datetime import UTC, timedelta

from starlette.concurrency import run_in_threadpool

from app.metering.delivery import UsageDelivery
from app.metering.outbox import Outbox
from app.metering.request_record import RequestRecord
from billing.usage import UsageRecord


class MeteringObserver:
    def __init__(self, outbox: Outbox, delivery: UsageDelivery) -> None:
        self.outbox = outbox
        self.delivery = delivery

    async def on_finish(self, record: RequestRecord) -> None:
        if record.usage is None:  # the engine never took it: nothing was processed, nothing to bill
            return
        usage = record.usage
        finished = record.started_at + timedelta(milliseconds=record.latency_ms)
        adapter = record.adapter
        usage_record = UsageRecord(
            request_id=record.request_id,
            tenant_id=record.tenant_id,
            key_id=record.key_id,
            model=record.model,
            base_model=record.base_model,
            adapter_id=None if adapter is None else adapter.adapter_id,
            adapter_version=None if adapter is None else adapter.version,
            status=record.status,
            finish_reason=record.finish_reason,
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_prompt_tokens,
            completion_tokens=usage.completion_tokens,
            gpu_ms=usage.gpu_ms,
            queue_ms=usage.queue_ms,
            ttft_ms=usage.ttft_ms,
            latency_ms=record.latency_ms,
            replica=usage.replica,
            started_at=record.started_at,
            finished_at=finished if finished.tzinfo else finished.replace(tzinfo=UTC),
            cost=None if record.cost is None else str(record.cost),
            currency=record.currency,
            batch_id=record.batch_id,
        )
        # Committed before the response ends, as before: on the loop if that needs no wait, else in a thread.
        if not self.outbox.try_add(usage_record):
            await run_in_threadpool(self.outbox.add, usage_record)
        self.delivery.soon()
