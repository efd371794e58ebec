"""The Batch API's request and answer shapes: BatchCreate (POST /v1/batches) and OpenAI's batch object."""

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.responses.request import Metadata
from billing.models import Batch

Endpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/responses"]  # BATCH_ENDPOINTS
STAMPS = ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=64, description="A file of purpose batch.")
    endpoint: Endpoint = Field(description="Where every line of the file is sent; each line's url is it.")
    completion_window: Literal["24h"] = Field(description="The batch's lines run within it, or expire.")
    metadata: Metadata | None = None


def _epoch(moment: datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp())


def batch_object(row: Batch) -> dict[str, Any]:
    """OpenAI's batch object, from its row."""
    return {
        "id": row.id,
        "object": "batch",
        "endpoint": row.endpoint,
        "errors": None if row.errors is None else {"object": "list", "data": row.errors},
        "input_file_id": row.input_file_id,
        "completion_window": row.completion_window,
        "status": row.status,
        "output_file_id": row.output_file_id,
        "error_file_id": row.error_file_id,
        "created_at": _epoch(row.created_at),
        "expires_at": _epoch(row.expires_at),
        **{f"{stamp}_at": _epoch(getattr(row, f"{stamp}_at")) for stamp in STAMPS},
        "request_counts": {"total": row.total, "completed": row.completed, "failed": row.failed},
        "metadata": row.metadata_,
    }
