"""5xx that schema fuzzing (tests/app/test_schema_fuzz.py) and probing around its findings turned up, each
pinned as the 4xx it should be (or as the 200 it now is), in the OpenAI error shape.

* GET /admin/routing?within_s=1e300 (or inf, or 1e12): timedelta / `now - within` overflowed: 500.
* A usage period or bill period whose UTC offset carries it past year 1 or 9999
  (0001-01-01T00:00:00+05:00): astimezone overflowed: 500.
* repetition_penalty below ~1e-36 with top_p < 1: logits / penalty overflow float32 in the sampler, the
  top-p bands index with NaN, and the engine step fails: 500 for the request and for every other
  request in the same batch.
"""

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from deployments.engine.interface import MIN_REPETITION_PENALTY
from tests.app.conftest import ADMIN_KEY, MODEL, Served

ERROR_KEYS = {"message", "type", "param", "code"}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def assert_error(r: httpx.Response, status: int, *, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers.get("x-request-id")
    body = r.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == ERROR_KEYS, body
    if param is not None:
        assert body["error"]["param"] == param, body
    return dict(body["error"])


@pytest.fixture(scope="module")
def client(served: Served, tenant: tuple[str, str]) -> Iterator[httpx.Client]:
    _, key = tenant
    with httpx.Client(base_url=served.url, headers={"authorization": f"Bearer {key}"}, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def admin(served: Served) -> Iterator[httpx.Client]:
    with served.admin() as client:
        yield client


# -- GET /admin/routing: within_s ------------------------------------------------------------------


@pytest.mark.parametrize("within_s", ["1e300", "inf", "1e12", "315360001"])
def test_a_routing_window_too_long_for_a_datetime_is_400(admin: httpx.Client, within_s: str) -> None:
    assert_error(admin.get("/admin/routing", params={"within_s": within_s}), 400, param="within_s")


@pytest.mark.parametrize("within_s", ["1e-320", "60", "315360000"])
def test_routing_windows_within_the_bound_are_answered(admin: httpx.Client, within_s: str) -> None:
    r = admin.get("/admin/routing", params={"within_s": within_s})
    assert r.status_code == 200, r.text


# -- usage and bill periods at the edges of the datetime range ------------------------------------

OUT_OF_RANGE = [
    ("start", "0001-01-01T00:00:00+05:00", "0001-01-02T00:00:00+05:00"),  # UTC: year 0
    ("start", "9999-12-31T20:00:00-05:00", "9999-12-31T23:00:00-05:00"),  # UTC: year 10000
    ("end", "9999-12-31T00:00:00Z", "9999-12-31T23:00:00-05:00"),
]


@pytest.mark.parametrize(("param", "start", "end"), OUT_OF_RANGE, ids=["year-0", "year-10000", "end-only"])
def test_a_usage_period_out_of_range_in_utc_is_400(
    client: httpx.Client, admin: httpx.Client, param: str, start: str, end: str
) -> None:
    period = {"start": start, "end": end}
    assert_error(client.get("/v1/usage", params=period), 400, param=param)
    assert_error(admin.get("/admin/usage", params=period), 400, param=param)


@pytest.mark.parametrize(("param", "start", "end"), OUT_OF_RANGE, ids=["year-0", "year-10000", "end-only"])
def test_a_bill_period_out_of_range_in_utc_is_400(
    admin: httpx.Client, tenant: tuple[str, str], param: str, start: str, end: str
) -> None:
    tenant_id, _ = tenant
    r = admin.get(f"/admin/tenants/{tenant_id}/bill", params={"start": start, "end": end})
    assert_error(r, 400, param=param)


def test_periods_at_the_edges_that_stay_in_range_are_answered(
    client: httpx.Client, admin: httpx.Client, tenant: tuple[str, str]
) -> None:
    tenant_id, _ = tenant
    for start, end in [
        ("0001-01-01T00:00:00", "0001-01-02T00:00:00"),
        ("9999-12-30T00:00:00Z", "9999-12-31T23:00:00Z"),
        ("0001-01-01T05:00:00+05:00", "0001-01-02T00:00:00Z"),
    ]:
        period = {"start": start, "end": end}
        assert client.get("/v1/usage", params=period).status_code == 200
        assert admin.get("/admin/usage", params=period).status_code == 200
        assert admin.get(f"/admin/tenants/{tenant_id}/bill", params=period).status_code == 200


# -- repetition_penalty small enough to overflow the sampler ----------------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("penalty", [5e-324, 1e-300, 1e-40, MIN_REPETITION_PENALTY / 2])
def test_a_repetition_penalty_below_the_floor_is_400(client: httpx.Client, path: str, penalty: float) -> None:
    body = {"model": MODEL, "max_tokens": 2, "top_p": 0.5, "repetition_penalty": penalty}
    body |= (
        {"messages": [{"role": "user", "content": "hello hello"}]} if path == CHAT else {"prompt": "hello"}
    )
    assert_error(client.post(path, json=body), 400, param="repetition_penalty")


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("temperature", [1.0, 2.0, 1e-5])
def test_the_smallest_repetition_penalty_generates(
    client: httpx.Client, path: str, temperature: float
) -> None:
    """At the floor the penalised logits stay finite, whatever the temperature and top_p/top_k/min_p."""
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 4,
        "temperature": temperature,
        "top_p": 0.5,
        "top_k": 5,
        "min_p": 0.1,
        "repetition_penalty": MIN_REPETITION_PENALTY,
        "seed": 1,
    }
    body |= {"messages": [{"role": "user", "content": "hello hello hello"}]} if path == CHAT else {}
    body |= {"prompt": "hello hello hello"} if path == COMPLETIONS else {}
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_the_documented_bounds_are_the_enforced_ones(served: Served) -> None:
    """The fuzzer generates from the document: its bounds must be the app's."""
    document = httpx.get(
        f"{served.url}/openapi.json", headers={"authorization": f"Bearer {ADMIN_KEY}"}
    ).json()
    fields = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    penalty = next(s for s in fields["repetition_penalty"]["anyOf"] if s.get("type") == "number")
    assert penalty["minimum"] == MIN_REPETITION_PENALTY
    routing = next(
        p for p in document["paths"]["/admin/routing"]["get"]["parameters"] if p["name"] == "within_s"
    )
    number = next(s for s in routing["schema"]["anyOf"] if s.get("type") == "number")
    assert number["exclusiveMinimum"] == 0
    assert number["maximum"] == 315_360_000
