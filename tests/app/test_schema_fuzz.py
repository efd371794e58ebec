"""Schema fuzzing of the HTTP API from its own OpenAPI document (schemathesis): no 5xx, no hang.

The document is read from the live app (GET /openapi.json) and every operation in it is fuzzed against the
real server and the in-process engine on the tiny model, with valid and invalid data (schemathesis'
coverage and fuzzing phases), as a tenant on /v1/* and as the admin on /admin/*. For every request:

* the answer is not a 5xx (`not_a_server_error`) and comes within REQUEST_TIMEOUT_S (no hang);
* a 2xx body matches the documented response schema (`response_schema_conformance`);
* a 4xx is the OpenAI error shape, and every answer carries x-request-id. (The documented 422 is never
  sent: bad requests are 400, see tests/app/test_error_contract.py; so statuses are not checked against
  the document.)

Three passes over the document:

* test_fuzz_operation: everything generated, ids in paths included (so mostly unknown objects: 404,
  and completions mostly name unknown models);
* test_fuzz_operation_on_real_objects: the operations that name an object (tier, tenant, key, adapter,
  model) or a period, with the name replaced by a real one: destructive operations (PATCH, DELETE,
  revoke) get an object made for the example, so they never touch what the rest of the run needs, and
  completions run on the base model or a public adapter, so the engine generates;
* test_a_fuzzed_authorization_header_is_refused: the Authorization header itself is fuzzed (the other
  passes take it out of the document and send valid credentials).

POST /admin/adapters reads its multipart body by hand, so the document has no request body for it and
it is only sent without one (a 400): tests/app/test_hostile_uploads.py covers real uploads.

Bounded and repeatable: a fixed seed, derandomized generation, no example database, MAX_EXAMPLES per
operation in the fuzzing phase, and completions of at most MAX_TOKENS_CAP tokens (the fuzz tenant's tier
has that max_tokens_cap, and generated max_tokens above it are brought down to it).
"""

import copy
import zlib
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from schemathesis import Case
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.core.transport import Response
from schemathesis.specs.openapi.checks import response_schema_conformance

from tests.app.conftest import ADMIN_KEY, MODEL, Served
from tests.app.helpers import unique
from tests.app.test_adapters_api import upload_files

FuzzCase = Case[Any]  # what schemathesis hands each example
SEED = 20_260_101
MAX_EXAMPLES = 10  # per operation, fuzzing phase (the coverage phase adds its boundary cases)
REQUEST_TIMEOUT_S = 30.0  # "no hang": every request is answered within this
# The fuzz tier's cap, so completions stay short. Not below 16: /v1/completions defaults max_tokens to 16,
# which a smaller cap refuses (400) whenever the request leaves it out.
MAX_TOKENS_CAP = 4
ERROR_KEYS = {"message", "type", "param", "code"}
CHECKS = [not_a_server_error, response_schema_conformance]
COMPLETIONS = ("/v1/chat/completions", "/v1/completions")
PERIODS = ("/v1/usage", "/admin/usage", "/admin/tenants/{tenant_id}/bill")
REAL_OBJECT_PATHS = (
    r"^/admin/(tiers/\{name\}|tenants/\{tenant_id\}.*|keys/\{key_id\}|adapters/\{adapter_id\}|usage)$"
    r"|^/v1/(chat/completions|completions|models/\{model_id\}|usage)$"
)


def _without_authorization(document: dict[str, Any]) -> dict[str, Any]:
    """The document with the Authorization header parameter taken out of every operation."""
    document = copy.deepcopy(document)
    for operations in document["paths"].values():
        for operation in operations.values():
            parameters = operation.get("parameters", [])
            operation["parameters"] = [p for p in parameters if p["name"].lower() != "authorization"]
    return document


def _only_authorization(document: dict[str, Any]) -> dict[str, Any]:
    """The document with only the Authorization header (and path parameters) left to generate: bodies and
    queries are never read without valid credentials, so generating them would only cost time."""
    document = copy.deepcopy(document)
    for operations in document["paths"].values():
        for operation in operations.values():
            parameters = operation.get("parameters", [])
            operation["parameters"] = [
                p for p in parameters if p["in"] == "path" or p["name"].lower() == "authorization"
            ]
            operation.pop("requestBody", None)
    return document


def _config(url: str) -> SchemathesisConfig:
    return SchemathesisConfig.from_dict(
        {
            "seed": SEED,
            "base-url": url,
            "request-timeout": REQUEST_TIMEOUT_S,
            "suppress-health-check": ["too_slow", "filter_too_much", "data_too_large"],
            "generation": {
                "mode": "all",  # valid and invalid data
                "max-examples": MAX_EXAMPLES,
                "deterministic": True,
                "database": "none",  # no examples replayed from earlier runs
            },
            "phases": {
                "examples": {"enabled": False},  # the document has none
                "coverage": {"enabled": True},
                "fuzzing": {"enabled": True},
                "stateful": {"enabled": False},
            },
        }
    )


class Fuzz:
    """Who the fuzzed requests run as, and the objects they may name.

    Long-lived objects (the fuzz tier, tenant and a public adapter) are only read by the examples;
    anything an example may change or delete is made for that example alone."""

    def __init__(self, served: Served) -> None:
        self.served = served
        self.tier_name = unique("fuzz")  # never a name the generator would come up with
        with served.admin() as admin:
            tier = {"name": self.tier_name, "max_tokens_cap": MAX_TOKENS_CAP}  # no rate limits: no 429s
            r = admin.post("/admin/tiers", json=tier)
            assert r.status_code == 201, r.text
        self.tenant_id, self.key = served.new_tenant(unique("fuzz"), tier=self.tier_name)
        self.adapter_id, adapter_name = self._upload()
        self.models = (MODEL, f"public/{adapter_name}")

    def headers_for(self, path: str) -> dict[str, str]:
        if path.startswith("/v1/"):
            return {"authorization": f"Bearer {self.key}"}
        if path.startswith("/admin/"):
            return {"authorization": f"Bearer {ADMIN_KEY}"}
        return {}

    def _upload(self) -> tuple[str, str]:
        name = unique("fuzz")
        source = next(iter(self.served.setup.adapter_dirs.values()))
        r = upload_files(self.served, name, "public", source)
        assert r.status_code == 201, r.text
        return str(r.json()["id"]), name

    def _new_tier(self) -> str:
        name = unique("victim")
        with self.served.admin() as admin:
            r = admin.post("/admin/tiers", json={"name": name})
        assert r.status_code == 201, r.text
        return name

    def _new_tenant(self) -> str:
        with self.served.admin() as admin:
            r = admin.post("/admin/tenants", json={"name": unique("victim")})
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    def _new_key(self) -> str:
        with self.served.admin() as admin:
            r = admin.post(f"/admin/tenants/{self._new_tenant()}/keys", json={"name": "victim"})
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    def object_for(self, parameter: str, *, changes: bool) -> str:
        """A real object for a path parameter: a new one when the operation may change or delete it."""
        if parameter == "model_id":
            return MODEL
        fresh: dict[str, Callable[[], str]] = {
            "name": self._new_tier,
            "tenant_id": self._new_tenant,
            "key_id": self._new_key,
            "adapter_id": lambda: self._upload()[0],
        }
        if changes:
            return fresh[parameter]()
        shared = {"name": self.tier_name, "tenant_id": self.tenant_id, "adapter_id": self.adapter_id}
        return shared[parameter] if parameter in shared else fresh[parameter]()

    def model_for(self, generated: str) -> str:
        """The base model or the public adapter, picked by the generated name (so repeatably)."""
        return self.models[zlib.crc32(generated.encode()) % len(self.models)]


@pytest.fixture(scope="module")
def fuzz(served: Served) -> Fuzz:
    return Fuzz(served)


@pytest.fixture(scope="module")
def openapi(served: Served) -> dict[str, Any]:
    r = httpx.get(f"{served.url}/openapi.json", timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 200
    document: dict[str, Any] = r.json()
    return document


@pytest.fixture(scope="module")
def api_schema(served: Served, openapi: dict[str, Any]) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_dict(_without_authorization(openapi), config=_config(served.url))


@pytest.fixture(scope="module")
def auth_schema(served: Served, openapi: dict[str, Any]) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_dict(_only_authorization(openapi), config=_config(served.url))


@pytest.fixture(scope="module")
def session() -> Iterator[requests.Session]:
    with requests.Session() as s:
        yield s


@pytest.fixture(autouse=True)
def _node_id_for_schemathesis(request: pytest.FixtureRequest) -> None:
    """schemathesis' lazy schemas (4.32) read and rename `node._nodeid`, which pytest 9.2 no longer has
    (it keeps a structured `_id`): give it the attribute to read; the renaming then changes nothing."""
    request.node._nodeid = request.node.nodeid


def _clamp_max_tokens(case: FuzzCase) -> None:
    """Asking for more than the tier's cap is a 400 (tested elsewhere); here the engine should run."""
    if not isinstance(case.body, dict):
        return
    for field in ("max_tokens", "max_completion_tokens"):
        value = case.body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS_CAP:
            case.body[field] = MAX_TOKENS_CAP


def _call_and_check(case: FuzzCase, fuzz: Fuzz, session: requests.Session) -> None:
    _clamp_max_tokens(case)
    headers = fuzz.headers_for(case.path)
    response = case.call(session=session, headers=headers, timeout=REQUEST_TIMEOUT_S)
    case.validate_response(response, checks=CHECKS, headers=headers)
    _check(case, response)


def _check(case: FuzzCase, response: Response) -> None:
    """Answered in time, not a 5xx, with x-request-id; a 4xx in the OpenAI error shape."""
    label = case.operation.label
    assert response.elapsed < REQUEST_TIMEOUT_S, f"{label} took {response.elapsed:.1f}s"
    assert response.status_code < 500, f"{label}: {response.status_code} {response.text[:500]}"
    assert response.headers.get("x-request-id"), f"{label}: no x-request-id"
    if 400 <= response.status_code < 500:
        body = response.json()
        assert set(body) == {"error"}, body
        assert set(body["error"]) == ERROR_KEYS, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], body


lazy_api = schemathesis.pytest.from_fixture("api_schema")
lazy_auth = schemathesis.pytest.from_fixture("auth_schema")


@lazy_api.parametrize()
def test_fuzz_operation(case: FuzzCase, fuzz: Fuzz, session: requests.Session) -> None:
    """Every operation, all of the request generated (ids in paths and model names included)."""
    _call_and_check(case, fuzz, session)


@lazy_api.include(path_regex=REAL_OBJECT_PATHS).parametrize()
def test_fuzz_operation_on_real_objects(case: FuzzCase, fuzz: Fuzz, session: requests.Session) -> None:
    """Operations naming an object or a period, on real ones: the rest of the request is generated."""
    changes = case.method.upper() != "GET"
    for name in list(case.path_parameters or {}):
        case.path_parameters[name] = fuzz.object_for(name, changes=changes)
    body = case.body
    if case.path in COMPLETIONS and isinstance(body, dict):
        model = body.get("model")
        if isinstance(model, str):
            body["model"] = fuzz.model_for(model)
        # The document allows an empty prompt (no minLength/minItems) that the app refuses with a 400;
        # generation leans on that minimal value, which would keep most examples off the engine.
        if body.get("prompt") in ("", []):
            body["prompt"] = "hi" if body["prompt"] == "" else [1]
    if case.path in PERIODS and case.query is not None:
        today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
        case.query["start"] = (today - timedelta(days=1)).isoformat()
        case.query["end"] = (today + timedelta(days=1)).isoformat()
        if "tenant_id" in case.query:
            case.query["tenant_id"] = fuzz.tenant_id
    _call_and_check(case, fuzz, session)


@lazy_auth.include(path_regex=r"^/(v1|admin)/").parametrize()
def test_a_fuzzed_authorization_header_is_refused(case: FuzzCase, session: requests.Session) -> None:
    """Whatever the Authorization header holds, or without one: 401 (405 for a method the path lacks)."""
    response = case.call(session=session, timeout=REQUEST_TIMEOUT_S)
    case.validate_response(response, checks=[not_a_server_error])
    _check(case, response)
    assert response.status_code in (401, 405), response.text
