"""Billing tables as SQLAlchemy 2 models, one noun per module:

- base: Base (its MetaData and naming convention), new_id, utcnow and the UTCDateTime column type;
- tier: Tier and LIMIT_FIELDS;  tenant: Tenant and TenantStatus;  api_key: ApiKey;
- adapter: the adapter registry (Adapter, AdapterVersion, PUBLIC_OWNER);
- usage: UsageEvent and UsageRollup;  stripe_export: StripeExport;  engine_report: EngineReport;
- stored_response: StoredResponse (the Responses API's stored responses);  storage_hold: StorageHold (the
  bytes responses in flight will store, against the storage quota).
- stored_file: StoredFile (the Files API);  batch: Batch;  batch_line: BatchLine (the Batch API, issue 37).

- credit: CreditEntry, SpendLimit, BudgetEvent (issue 29);  price: PriceChange (effective-dated prices).

Importing this package imports every module, so Base.metadata holds every table (migrations/env.py relies
on it) and foreign keys named as strings ("tenants.id") resolve; import the names from here.

Migrations are written by hand in migrations/versions/; tests/billing/test_migrations.py compares the two
with Alembic's autogenerate so they cannot drift.
"""

# isort: off
# Referenced tables before those that refer to them, as in the former single module: Base.metadata.tables
# keeps the order it always had.
from billing.models.base import NAMING_CONVENTION, Base, UTCDateTime, new_id, utcnow
from billing.models.tier import LIMIT_FIELDS, Tier
from billing.models.tenant import Tenant, TenantStatus
from billing.models.api_key import ApiKey
from billing.models.adapter import PUBLIC_OWNER, Adapter, AdapterVersion
from billing.models.usage import BASE_ADAPTER_KEY, STORAGE_MODEL, UsageEvent, UsageRollup
from billing.models.stripe_export import StripeExport
from billing.models.engine_report import EngineReport
from billing.models.stored_response import StoredResponse

from billing.models.credit import PERIODS, SURFACES, BudgetEvent, CreditEntry, SpendLimit
from billing.models.price import PriceChange
from billing.models.stored_file import FILE_PURPOSES, StoredFile
from billing.models.batch import ACTIVE_BATCH_STATUSES, BATCH_ENDPOINTS, BATCH_STATUSES, Batch
from billing.models.batch_line import LINE_STATES, BatchLine
from billing.models.storage_hold import StorageHold
# isort: on

__all__ = [
    "ACTIVE_BATCH_STATUSES",
    "BASE_ADAPTER_KEY",
    "BATCH_ENDPOINTS",
    "BATCH_STATUSES",
    "FILE_PURPOSES",
    "LIMIT_FIELDS",
    "LINE_STATES",
    "NAMING_CONVENTION",
    "PERIODS",
    "PUBLIC_OWNER",
    "STORAGE_MODEL",
    "SURFACES",
    "Adapter",
    "AdapterVersion",
    "ApiKey",
    "Base",
    "Batch",
    "BatchLine",
    "BudgetEvent",
    "CreditEntry",
    "EngineReport",
    "PriceChange",
    "SpendLimit",
    "StorageHold",
    "StoredFile",
    "StoredResponse",
    "StripeExport",
    "Tenant",
    "TenantStatus",
    "Tier",
    "UTCDateTime",
    "UsageEvent",
    "UsageRollup",
    "new_id",
    "utcnow",
]
