"""Usage metering: every request that reached an engine becomes exactly one billing row.

    engine step (deployments/engine/llm_engine.py)
      | RequestUsage on every RequestOutput: tokens so far, queue/TTFT times, this request's share of
      | each step's device time (split by tokens processed), the replica
      v
    app/completions/generation.py: the request ends (completed, client gone, failed) -> one RequestRecord
      v
    request_record.py   RequestRecord, RequestObserver (metrics listen here too: app/request_metrics.py)
    observer.py         MeteringObserver: RequestRecord -> billing.usage.UsageRecord, durably into...
    outbox.py           Outbox: a SQLite file per node; rows claimed with a lease, so a dead replica's
      |                 rows are delivered by another
    delivery.py         UsageDelivery: background task, batches, backs off while metering is away
      v  MeteringSink
    database_sink.py    DatabaseSink: straight into the database (single process, tests)
    deployments/metering.py  ServeMeteringSink -> the Metering deployment -> DatabaseSink
      v
    billing/usage.py    record_usage: insert-or-ignore on the request id -> usage_events row;
                        rollup_hours -> usage_rollups -> billing/stripe_export.py -> Stripe meter events

Retries anywhere in the chain are safe: the request id is the row's key all the way down.
"""
