"""The error contract over HTTP: x-request-id on every response, the OpenAI error shape, 400 (never 422)
for bad requests with `param` naming the field, and the engine's own refusals (unknown model, context
length, token ids out of range) turned into proper 4xx before any stream starts.
"""

import json
import re
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.app.conftest import ADMIN_KEY, MODEL, Served

GENERATED_ID = re.compile(r"^req_[0-9a-f]{32}$")
ERROR_KEYS = {"message", "type", "param", "code"}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
VOCAB_SIZE = 2048  # the tiny model's vocabulary (app/modelprep/demo_model.py, preset "tiny")
CONTEXT = 1024
CONTRACT_TENANT = f"contract-{uuid.uuid4().hex[:8]}"  # its max_position_embeddings


def assert_error(
    r: httpx.Response, status: int, *, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """The response is an OpenAI error with all four keys; returns the inner error object."""
    assert r.status_code == status, r.text
    assert r.headers.get("x-request-id"), "every error carries x-request-id"
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == ERROR_KEYS, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return dict(error)


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


def completion_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra}


@pytest.fixture(scope="module")
def tenant(served: Served) -> tuple[str, str]:
    """Unlimited: this module sends hundreds of refused requests, and each counts against RPM."""
    return served.new_tenant(CONTRACT_TENANT, tier="enterprise")


@pytest.fixture(scope="module")
def client(served: Served, tenant: tuple[str, str]) -> Iterator[httpx.Client]:
    """A tenant's client (module scoped, like the server)."""
    _, key = tenant
    with httpx.Client(base_url=served.url, headers={"authorization": f"Bearer {key}"}, timeout=30) as c:
        yield c


# -- x-request-id: every response, whatever its status ---------------------------------------------

Call = Callable[[httpx.Client, dict[str, str]], httpx.Response]


def _bad_json(c: httpx.Client, h: dict[str, str]) -> httpx.Response:
    return c.post(CHAT, content=b'{"model": ', headers={**h, "content-type": "application/json"})


def _admin_conflict(c: httpx.Client, h: dict[str, str]) -> httpx.Response:
    admin = {**h, "authorization": f"Bearer {ADMIN_KEY}"}
    return c.post("/admin/tenants", json={"name": CONTRACT_TENANT}, headers=admin)  # `tenant`'s name


def _admin_created(c: httpx.Client, h: dict[str, str]) -> httpx.Response:
    admin = {**h, "authorization": f"Bearer {ADMIN_KEY}"}
    return c.post("/admin/tenants", json={"name": f"rid-{uuid.uuid4().hex}"}, headers=admin)


# (name, expected status, call); the call gets extra headers to send.
RESPONSES: list[tuple[str, int, Call]] = [
    ("chat-200", 200, lambda c, h: c.post(CHAT, json=chat_body(temperature=0), headers=h)),
    ("completion-200", 200, lambda c, h: c.post(COMPLETIONS, json=completion_body(), headers=h)),
    ("models-200", 200, lambda c, h: c.get("/v1/models", headers=h)),
    ("stream-200", 200, lambda c, h: c.post(CHAT, json=chat_body(stream=True), headers=h)),
    ("no-key-401", 401, lambda c, h: c.post(CHAT, json=chat_body(), headers={**h, "authorization": ""})),
    ("admin-401", 401, lambda c, h: c.get("/admin/tenants", headers=h)),
    ("validation-400", 400, lambda c, h: c.post(CHAT, json=chat_body(temperature=3), headers=h)),
    ("bad-json-400", 400, _bad_json),
    ("stream-validation-400", 400, lambda c, h: c.post(CHAT, json=chat_body(stream=True, n=0), headers=h)),
    ("unknown-model-404", 404, lambda c, h: c.post(CHAT, json=chat_body(model="nope"), headers=h)),
    ("unknown-route-404", 404, lambda c, h: c.get("/v1/nope", headers=h)),
    ("method-405", 405, lambda c, h: c.delete("/v1/models", headers=h)),
    ("admin-201", 201, _admin_created),
    ("admin-409", 409, _admin_conflict),
]
RESPONSE_IDS = [name for name, _, _ in RESPONSES]


@pytest.mark.parametrize(("name", "status", "call"), RESPONSES, ids=RESPONSE_IDS)
def test_a_request_id_is_generated_when_none_is_sent(
    client: httpx.Client, name: str, status: int, call: Call
) -> None:
    first, second = call(client, {}), call(client, {})
    assert first.status_code == status, first.text
    assert GENERATED_ID.match(first.headers["x-request-id"]), first.headers
    assert GENERATED_ID.match(second.headers["x-request-id"])
    assert first.headers["x-request-id"] != second.headers["x-request-id"]


@pytest.mark.parametrize(("name", "status", "call"), RESPONSES, ids=RESPONSE_IDS)
def test_a_valid_request_id_is_echoed(client: httpx.Client, name: str, status: int, call: Call) -> None:
    request_id = f"client.{name}:{uuid.uuid4().hex}"
    r = call(client, {"x-request-id": request_id})
    assert r.status_code == status, r.text
    assert r.headers["x-request-id"] == request_id


@pytest.mark.parametrize(
    "request_id",
    ["A-z_0.9:x", "x" * 128, "1"],
    ids=["all-allowed-characters", "128-characters", "one-character"],
)
def test_valid_request_ids_at_the_edges_are_echoed(client: httpx.Client, request_id: str) -> None:
    r = client.get("/v1/models", headers={"x-request-id": request_id})
    assert r.status_code == 200
    assert r.headers["x-request-id"] == request_id


@pytest.mark.parametrize(
    "request_id",
    ["x" * 129, "has space", "a/b", "semi;colon", "quote'", "<script>", "tab\there", ""],
    ids=["129-characters", "space", "slash", "semicolon", "quote", "angle-brackets", "tab", "empty"],
)
@pytest.mark.parametrize("status", [200, 400, 401])
def test_an_invalid_request_id_is_replaced(
    served: Served, client: httpx.Client, request_id: str, status: int
) -> None:
    headers = {"x-request-id": request_id}
    if status == 200:
        r = client.post(CHAT, json=chat_body(temperature=0), headers=headers)
    elif status == 400:
        r = client.post(CHAT, json=chat_body(top_p=0), headers=headers)
    else:
        r = httpx.get(f"{served.url}/v1/models", headers=headers)
    assert r.status_code == status, r.text
    assert GENERATED_ID.match(r.headers["x-request-id"]), r.headers
    if status == 200:
        assert r.json()["id"] == r.headers["x-request-id"]


def test_a_non_ascii_request_id_is_replaced(served: Served, tenant: tuple[str, str]) -> None:
    _, key = tenant
    headers = [(b"authorization", f"Bearer {key}".encode()), (b"x-request-id", "réq".encode("latin-1"))]
    r = httpx.get(f"{served.url}/v1/models", headers=headers)
    assert r.status_code == 200
    assert GENERATED_ID.match(r.headers["x-request-id"])


def test_response_ids_are_ours_and_the_callers_id_is_only_echoed(client: httpx.Client) -> None:
    """The id that reaches the engine and billing is generated here; a caller's id is a trace label."""
    request_id = f"trace-{uuid.uuid4().hex}"
    r = client.post(COMPLETIONS, json=completion_body(), headers={"x-request-id": request_id})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == request_id
    assert GENERATED_ID.match(r.json()["id"])
    plain = client.post(COMPLETIONS, json=completion_body())
    assert plain.json()["id"] == plain.headers["x-request-id"]  # no trace id given: one id for both


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_every_stream_chunk_carries_the_request_id(client: httpx.Client, path: str) -> None:
    request_id = f"stream-{uuid.uuid4().hex}"
    body = (chat_body if path == CHAT else completion_body)(stream=True, max_tokens=4)
    with client.stream("POST", path, json=body, headers={"x-request-id": request_id}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"] == request_id
        data = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1
    assert GENERATED_ID.match(ids.pop())


def test_concurrent_requests_may_reuse_a_request_id(served: Served, tenant: tuple[str, str]) -> None:
    """A correlation id is the caller's label: reusing it (retries, another tenant) must not fail."""
    _, key = tenant
    _, other_key = served.new_tenant(f"rid-other-{uuid.uuid4().hex}")
    request_id = f"shared-{uuid.uuid4().hex}"
    long_stream = completion_body(prompt="x", max_tokens=CONTEXT - 8, temperature=0, stream=True)
    with httpx.Client(base_url=served.url, timeout=30) as c:
        first_headers = {"authorization": f"Bearer {key}", "x-request-id": request_id}
        with c.stream("POST", COMPLETIONS, json=long_stream, headers=first_headers) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # kept referenced: a dropped iterator closes the stream
            assert next(line for line in lines if line.startswith("data: "))  # generation is under way
            second_headers = {"authorization": f"Bearer {other_key}", "x-request-id": request_id}
            second = c.post(COMPLETIONS, json=completion_body(max_tokens=1), headers=second_headers)
    assert second.status_code == 200, second.text
    assert second.headers["x-request-id"] == request_id


# -- the error shape --------------------------------------------------------------------------------


def test_unknown_route_is_an_openai_error(client: httpx.Client) -> None:
    error = assert_error(client.get("/v1/does-not-exist"), 404)
    assert error["type"] == "invalid_request_error"


def test_wrong_method_is_an_openai_error(client: httpx.Client) -> None:
    assert_error(client.get(CHAT), 405)


# -- request validation: 400 with the field named -----------------------------------------------------

# (test id, endpoint, body, expected param)
INVALID: list[tuple[str, str, dict[str, Any], str]] = [
    ("temperature-3", CHAT, chat_body(temperature=3), "temperature"),
    ("temperature-negative", COMPLETIONS, completion_body(temperature=-0.1), "temperature"),
    ("top_p-0", CHAT, chat_body(top_p=0), "top_p"),
    ("top_p-above-1", COMPLETIONS, completion_body(top_p=1.5), "top_p"),
    ("max_tokens-0", CHAT, chat_body(max_tokens=0), "max_tokens"),
    ("max_tokens-0-completions", COMPLETIONS, completion_body(max_tokens=0), "max_tokens"),
    ("max_completion_tokens-0", CHAT, chat_body(max_completion_tokens=0), "max_completion_tokens"),
    ("n-0", CHAT, chat_body(n=0), "n"),
    ("n-over-the-limit-completions", COMPLETIONS, completion_body(n=1000), "n"),
    ("n-over-the-deployment-limit", CHAT, chat_body(n=9), "n"),  # Settings.max_n, 8 by default
    ("5-stop-strings", CHAT, chat_body(stop=["a", "b", "c", "d", "e"]), "stop"),
    ("5-stop-strings-completions", COMPLETIONS, completion_body(stop=list("abcde")), "stop"),
    ("empty-stop-string", CHAT, chat_body(stop=[""]), "stop"),
    ("empty-messages", CHAT, chat_body(messages=[]), "messages"),
    ("messages-not-a-list", CHAT, chat_body(messages="hi"), "messages"),
    ("missing-messages", CHAT, {"model": MODEL}, "messages"),
    ("missing-model", CHAT, {"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("missing-model-completions", COMPLETIONS, {"prompt": "hi"}, "model"),
    ("empty-model", CHAT, chat_body(model=""), "model"),
    ("missing-prompt", COMPLETIONS, {"model": MODEL}, "prompt"),
    ("empty-token-prompt", COMPLETIONS, completion_body(prompt=[]), "prompt"),
    ("echo-not-bool", COMPLETIONS, completion_body(echo="yes"), "echo"),
    ("logprobs-over-5", COMPLETIONS, completion_body(logprobs=6), "logprobs"),
    ("top-logprobs-without-logprobs", CHAT, chat_body(top_logprobs=1), "top_logprobs"),
    ("logit-bias-out-of-vocab", CHAT, chat_body(logit_bias={"1000000": 1}), "logit_bias"),
    ("response-format-unknown", CHAT, chat_body(response_format={"type": "xml"}), "response_format"),
    ("tool-choice-without-tools", CHAT, chat_body(tool_choice="required"), "tool_choice"),
    ("seed-negative", COMPLETIONS, completion_body(seed=-1), "seed"),
    ("stream-not-bool", CHAT, chat_body(stream="maybe"), "stream"),
]


@pytest.mark.parametrize(("path", "body", "param"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_requests_are_400_naming_the_field(
    client: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    assert_error(client.post(path, json=body), 400, param=param)


@pytest.mark.parametrize("role", ["bot", "function", "", None], ids=["bot", "function", "empty", "null"])
def test_bad_role_is_400_naming_the_message_field(client: httpx.Client, role: str | None) -> None:
    body = chat_body(messages=[{"role": "user", "content": "a"}, {"role": role, "content": "b"}])
    error = assert_error(client.post(CHAT, json=body), 400)
    assert error["param"] is not None
    assert error["param"].startswith("messages")
    assert "1" in error["param"] and "role" in error["param"], error  # which message, which field


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("field", ["foo", "logit_bias_x", "functions"])
def test_unknown_fields_are_refused_by_name(client: httpx.Client, path: str, field: str) -> None:
    body = (chat_body if path == CHAT else completion_body)(**{field: 1})
    error = assert_error(client.post(path, json=body), 400, param=field)
    assert error["message"] == f"Unrecognized request argument supplied: {field}"


def test_unknown_field_inside_a_message_is_refused(client: httpx.Client) -> None:
    body = chat_body(messages=[{"role": "user", "content": "hi", "mood": "happy"}])
    error = assert_error(client.post(CHAT, json=body), 400)
    assert error["param"] is not None and error["param"].endswith("mood")
    assert error["message"].startswith("Unrecognized request argument supplied: ")


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_stream_options_without_stream_is_400(client: httpx.Client, path: str) -> None:
    body = (chat_body if path == CHAT else completion_body)(stream_options={"include_usage": True})
    error = assert_error(client.post(path, json=body), 400)
    assert "stream_options" in error["message"]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_stream_options_without_stream_names_the_field(client: httpx.Client, path: str) -> None:
    body = (chat_body if path == CHAT else completion_body)(stream_options={"include_usage": True})
    assert_error(client.post(path, json=body), 400, param="stream_options")


def test_stream_options_with_stream_is_accepted(client: httpx.Client) -> None:
    body = chat_body(stream=True, stream_options={"include_usage": True})
    with client.stream("POST", CHAT, json=body) as r:
        assert r.status_code == 200
        r.read()


MALFORMED_BODIES = [
    pytest.param(b'{"model": ', "application/json", id="truncated-json"),
    pytest.param(b'{"model": "tiny-llama",}', "application/json", id="trailing-comma"),
    pytest.param(b"not json at all", "application/json", id="not-json"),
    pytest.param(b"[1, 2]", "application/json", id="json-array"),
    pytest.param(b'"just a string"', "application/json", id="json-string"),
    pytest.param(b"", "application/json", id="empty-body"),
    pytest.param(b"model=tiny-llama", "application/x-www-form-urlencoded", id="form-body"),
]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(("content", "content_type"), MALFORMED_BODIES)
def test_malformed_bodies_are_400(client: httpx.Client, path: str, content: bytes, content_type: str) -> None:
    assert_error(client.post(path, content=content, headers={"content-type": content_type}), 400)


@pytest.mark.parametrize("content", [b"{", b'{"model": ', b"not json"], ids=["brace", "truncated", "text"])
def test_unparseable_json_says_so(client: httpx.Client, content: bytes) -> None:
    r = client.post(CHAT, content=content, headers={"content-type": "application/json"})
    error = assert_error(r, 400)
    assert error["message"] == "We could not parse the JSON body of your request."


@pytest.mark.parametrize("content", [b"{", b'{"model": '], ids=["brace", "truncated"])
def test_unparseable_json_names_no_param(client: httpx.Client, content: bytes) -> None:
    r = client.post(CHAT, content=content, headers={"content-type": "application/json"})
    assert assert_error(r, 400)["param"] is None


def test_validation_never_answers_422(client: httpx.Client) -> None:
    """One request per kind of pydantic failure: none leaks FastAPI's default 422."""
    bodies = [row[2] for row in INVALID] + [chat_body(stream_options={"include_usage": True})]
    for body in bodies:
        assert client.post(CHAT, json=body).status_code == 400, body


# -- models -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, chat_body(model="no-such-model")),
        (COMPLETIONS, completion_body(model="no-such-model")),
        (CHAT, chat_body(model="no-such-model", stream=True)),
        (COMPLETIONS, completion_body(model="TINY-LLAMA")),
    ],
    ids=["chat", "completions", "chat-stream", "case-differs"],
)
def test_unknown_model_is_404(client: httpx.Client, path: str, body: dict[str, Any]) -> None:
    error = assert_error(client.post(path, json=body), 404, code="model_not_found", param="model")
    assert body["model"] in error["message"]


def test_unknown_model_card_is_404(client: httpx.Client) -> None:
    assert_error(client.get("/v1/models/no-such-model"), 404, code="model_not_found", param="model")


def test_models_lists_the_base_model(client: httpx.Client) -> None:
    r = client.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    cards = {card["id"]: card for card in body["data"]}
    assert MODEL in cards
    assert cards[MODEL]["object"] == "model"
    assert cards[MODEL]["max_model_len"] == CONTEXT
    one = client.get(f"/v1/models/{MODEL}")
    assert one.status_code == 200
    assert one.json() == cards[MODEL]


# -- refusals by the engine, before any status is sent -----------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, chat_body(messages=[{"role": "user", "content": "hello " * 2000}])),
        (COMPLETIONS, completion_body(prompt="hello " * 2000)),
        (COMPLETIONS, completion_body(prompt=[5] * (CONTEXT + 1))),
        (COMPLETIONS, completion_body(prompt=[5] * CONTEXT)),  # no room left for a single output token
        (COMPLETIONS, completion_body(prompt=[5] * 10, max_tokens=CONTEXT)),  # prompt + max_tokens too long
        (CHAT, chat_body(messages=[{"role": "user", "content": "hello " * 2000}], stream=True)),
        (COMPLETIONS, completion_body(prompt=[5] * (CONTEXT + 1), stream=True)),
    ],
    ids=[
        "chat",
        "completions-text",
        "completions-token-ids",
        "prompt-fills-context",
        "max-tokens-overflows",
        "chat-stream",
        "completions-stream",
    ],
)
def test_context_length_exceeded_is_400(client: httpx.Client, path: str, body: dict[str, Any]) -> None:
    error = assert_error(client.post(path, json=body), 400, code="context_length_exceeded")
    assert str(CONTEXT) in error["message"]


def test_a_prompt_that_just_fits_is_served(client: httpx.Client) -> None:
    body = completion_body(prompt=[5] * (CONTEXT - 1), max_tokens=1)
    r = client.post(COMPLETIONS, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == CONTEXT - 1


def test_context_length_exceeded_on_completions_names_the_prompt(client: httpx.Client) -> None:
    body = completion_body(prompt=[5] * (CONTEXT + 1))
    assert_error(client.post(COMPLETIONS, json=body), 400, code="context_length_exceeded", param="prompt")


def test_context_length_exceeded_on_chat_names_the_messages(client: httpx.Client) -> None:
    body = chat_body(messages=[{"role": "user", "content": "hello " * 2000}])
    assert_error(client.post(CHAT, json=body), 400, code="context_length_exceeded", param="messages")


@pytest.mark.parametrize(
    "prompt",
    [[1, VOCAB_SIZE], [VOCAB_SIZE + 5], [-1], [3, -7, 4], [2**40], [2**64]],
    ids=["vocab-size", "above-vocab", "negative", "negative-inside", "huge", "beyond-int64"],
)
@pytest.mark.parametrize("stream", [False, True])
def test_out_of_range_token_ids_are_400(client: httpx.Client, prompt: list[int], stream: bool) -> None:
    r = client.post(COMPLETIONS, json=completion_body(prompt=prompt, stream=stream))
    error = assert_error(r, 400, param="prompt")
    assert str(VOCAB_SIZE) in error["message"]


def test_in_range_token_ids_are_served(client: httpx.Client) -> None:
    r = client.post(COMPLETIONS, json=completion_body(prompt=[0, 1, VOCAB_SIZE - 1]))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 3


def test_empty_text_prompt_is_400(client: httpx.Client) -> None:
    assert_error(client.post(COMPLETIONS, json=completion_body(prompt="")), 400, param="prompt")


def test_a_refused_request_leaves_the_server_serving(client: httpx.Client) -> None:
    for body in (completion_body(prompt=[VOCAB_SIZE]), completion_body(prompt=[5] * (CONTEXT + 1))):
        assert client.post(COMPLETIONS, json=body).status_code == 400
    r = client.post(CHAT, json=chat_body(temperature=0))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def test_an_unavailable_database_is_a_503_not_a_500(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    from sqlalchemy.exc import OperationalError

    def refused() -> Any:
        raise OperationalError("SELECT 1", {}, ConnectionRefusedError("connection refused"))

    monkeypatch.setattr(served.services, "session_factory", refused)
    with served.admin() as admin:
        answer = admin.get("/admin/tenants")
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
    error = answer.json()["error"]
    assert (error["code"], error["type"]) == ("database_unavailable", "server_error")
    assert "refused" not in error["message"]  # the driver's details stay in the log
