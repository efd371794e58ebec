"""Shared by the tests of the OpenAI features (structured output, tools, logprobs, choices): a tenant with
an adapter of its own, and the SDK clients for it."""

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from openai import BadRequestError, OpenAI

from tests.app.conftest import MODEL, Served
from tests.app.test_adapters_api import upload_files
from tests.app.test_metering import usage_rows

ADAPTER = "tuned"
MODELS = [MODEL, ADAPTER]  # every feature runs on the base model and on an adapter


@dataclass(frozen=True)
class Account:
    tenant_id: str
    key: str
    client: OpenAI


def best_of(runs: int, work: Callable[[], object]) -> float:
    """The shortest of `runs` timings of `work`, in seconds: for comparing with a baseline timed in the
    same test (a neighbour's burst lengthens some runs, rarely all of them)."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def account_with_adapter(served: Served, prefix: str) -> Account:
    tenant_id, key = served.new_tenant(f"{prefix}-{uuid.uuid4().hex[:8]}")
    response = upload_files(served, ADAPTER, tenant_id, served.setup.adapter_dirs["demo-sql"])
    assert response.status_code == 201, response.text
    return Account(tenant_id, key, OpenAI(base_url=f"{served.url}/v1", api_key=key, max_retries=0))


def account_without_adapter(served: Served, prefix: str) -> Account:
    """A tenant for refused requests only: it must never have a usage row."""
    tenant_id, key = served.new_tenant(f"{prefix}-{uuid.uuid4().hex[:8]}")
    return Account(tenant_id, key, OpenAI(base_url=f"{served.url}/v1", api_key=key, max_retries=0))


def assert_refused(
    served: Served, account: Account, call: Callable[[], object], param: str
) -> dict[str, Any]:
    """`call` is a 400 naming `param` (or a field inside it), and leaves no usage row."""
    with pytest.raises(BadRequestError) as raised:
        call()
    error = raised.value.body
    assert isinstance(error, dict), error
    assert error.get("type") == "invalid_request_error", error
    assert (error.get("param") or "").startswith(param), error
    served.services.delivery.wake()
    time.sleep(0.2)  # a row would be delivered by now
    assert usage_rows(served, account.tenant_id) == []
    return error
