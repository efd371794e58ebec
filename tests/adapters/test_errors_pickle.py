"""Named errors survive pickling (Ray Serve ships a replica's exception to the caller that way)."""

import pickle

import pytest

from adapters.errors import AdapterInvalid, AdapterNotFound, AdapterRankTooLarge, AdapterStoreUnavailable
from billing.errors import TenantNotFound
from deployments.engine.errors import EmptyPrompt, InvalidRequest, InvalidSamplingParams, PromptTooLong


@pytest.mark.parametrize(
    "error",
    [
        PromptTooLong(5000, 16, 1024),
        EmptyPrompt(),
        InvalidRequest("bad", param="prompt"),
        InvalidSamplingParams("top_p must be in (0, 1], got 0", param="top_p"),
        AdapterNotFound("x@v1"),
        AdapterInvalid(["a", "b"]),
        AdapterRankTooLarge(32, 16),
        AdapterStoreUnavailable("s3://bucket/adapters", "connection refused"),
        TenantNotFound("ten_1"),
    ],
)
def test_round_trip_keeps_type_message_and_fields(error: Exception) -> None:
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    assert copy.__dict__ == error.__dict__
