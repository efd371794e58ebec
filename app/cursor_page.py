"""Cursor pagination as OpenAI's list endpoints do it (files, batches): rows ordered by creation time, then
id; `after` names the last row a client has; the answer is a list with `first_id`, `last_id`, `has_more`."""

from datetime import datetime
from typing import Any, Literal

from sqlalchemy import ColumnElement, and_, or_
from sqlalchemy.orm import InstrumentedAttribute

Order = Literal["asc", "desc"]


def beyond(
    created: InstrumentedAttribute[datetime],
    ids: InstrumentedAttribute[str],
    cursor: tuple[datetime, str],
    order: Order,
) -> ColumnElement[bool]:
    """The rows after the row `cursor` (its creation time and id) in (created, id) order."""
    at, cursor_id = cursor
    if order == "asc":
        return or_(created > at, and_(created == at, ids > cursor_id))
    return or_(created < at, and_(created == at, ids < cursor_id))


def list_page(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": more,
    }
