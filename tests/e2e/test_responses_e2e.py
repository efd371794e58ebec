"""The Responses API on Ray Serve, through the OpenAI SDK: create (base model and adapter), stream with
the SDK's helpers, tools and structured output on the chat path's grammar, stored responses (retrieve,
input items, delete, continue), tenant isolation, truncation, refusals by name, one usage row each; a
stream whose engine replica is killed mid-generation ends with `error` and `response.failed`."""

import json
import time
import uuid
from typing import Any, Literal

import httpx
import jsonschema
import pytest
import ray
from openai import BadRequestError, NotFoundError, OpenAI
from openai.types.responses import FunctionToolParam
from pydantic import BaseModel, Field
from sqlalchemy import select

from billing.models import StoredResponse, UsageEvent
from tests.e2e.conftest import ServeApp
from tests.e2e.test_adapters_e2e import upload

MODEL = "tiny-llama"
ADAPTER = "responder"
WEATHER: FunctionToolParam = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
            "unit": {"type": "string", "enum": ["c", "f"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
STREAM_ORDER = [  # a text response's events, each kind once or as a run, in this order
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


class Pet(BaseModel):  # bounded everywhere: a random model finishes it well within 96 tokens
    kind: Literal["cat", "dog", "fish"]
    name: str = Field(min_length=1, max_length=6)
    vaccinated: bool


@pytest.fixture(scope="module")
def tenant(serve_app: ServeApp) -> tuple[str, str]:
    tenant_id, key = serve_app.new_tenant(f"responses-{uuid.uuid4().hex[:8]}")
    source = serve_app.setups["llama"].adapter_dirs["demo-sql"]
    assert upload(serve_app, ADAPTER, tenant_id, source, MODEL).status_code == 201
    return tenant_id, key


@pytest.fixture(scope="module")
def client(serve_app: ServeApp, tenant: tuple[str, str]) -> OpenAI:
    return OpenAI(base_url=f"{serve_app.url}/v1", api_key=tenant[1], max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def other(serve_app: ServeApp) -> OpenAI:
    key = serve_app.new_tenant(f"responses-other-{uuid.uuid4().hex[:8]}")[1]
    return OpenAI(base_url=f"{serve_app.url}/v1", api_key=key, max_retries=0, timeout=60)


def usage_rows(app: ServeApp, response_ids: list[str], timeout: float = 60.0) -> list[UsageEvent]:
    """The usage rows of these responses (a response's request id is its own, as `req_`), once all came."""
    ids = [f"req_{r.removeprefix('resp_')}" for r in response_ids]
    deadline = time.monotonic() + timeout
    while True:
        with app.sessions()() as s:
            rows = list(s.scalars(select(UsageEvent).where(UsageEvent.request_id.in_(ids))))
        if len(rows) >= len(ids) or time.monotonic() > deadline:
            return rows
        time.sleep(0.25)


@pytest.mark.parametrize("model", [MODEL, ADAPTER])
def test_a_response_is_the_chat_completion_of_its_input(client: OpenAI, model: str) -> None:
    response = client.responses.create(
        model=model, instructions="Be brief.", input="Tell me about the sea.", max_output_tokens=12,
        temperature=0, metadata={"case": "plain"},
    )  # fmt: skip
    chat = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Tell me about the sea."},
        ],
        max_tokens=12,
        temperature=0,
    )
    assert response.id.startswith("resp_") and response.object == "response" and response.model == model
    assert response.output_text == chat.choices[0].message.content
    assert [item.type for item in response.output] == ["message"]
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.metadata == {"case": "plain"} and response.instructions == "Be brief."
    if chat.choices[0].finish_reason == "length":
        assert response.status == "incomplete"
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed"


def test_the_stream_sends_typed_events_in_order_and_ends_like_the_whole_response(client: OpenAI) -> None:
    whole = client.responses.create(model=MODEL, input="Sing.", max_output_tokens=10, temperature=0)
    events = list(
        client.responses.create(model=MODEL, input="Sing.", max_output_tokens=10, temperature=0, stream=True)
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    runs = [k for n, k in enumerate(kinds) if n == 0 or kinds[n - 1] != k]
    assert runs == [*STREAM_ORDER, f"response.{whole.status}"]
    final = events[-1].response  # type: ignore[union-attr]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == final.output_text
    assert final.usage is not None and whole.usage is not None and final.status == whole.status
    assert (final.usage.input_tokens, final.usage.output_tokens) == (
        whole.usage.input_tokens,
        whole.usage.output_tokens,
    )


def test_the_sdk_stream_helper_assembles_a_structured_response(client: OpenAI) -> None:
    with client.responses.stream(
        model=ADAPTER, input="Describe a pet.", text_format=Pet, max_output_tokens=96, temperature=0
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed"
    assert isinstance(final.output_parsed, Pet)
    assert "".join(deltas) == final.output_text
    parsed = client.responses.parse(
        model=ADAPTER, input="Describe a pet.", text_format=Pet, max_output_tokens=96, temperature=0
    )
    assert parsed.output_parsed == final.output_parsed


def test_json_object_format_is_json(client: OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, input="JSON please", text={"format": {"type": "json_object"}}, max_output_tokens=64,
        temperature=0,
    )  # fmt: skip
    if response.status == "completed":
        assert isinstance(json.loads(response.output_text), dict)
    else:  # cut at max_output_tokens: still the start of an object
        assert response.output_text.startswith("{")


def test_required_tools_call_then_continue_with_the_output_reusing_the_prefix(client: OpenAI) -> None:
    first = client.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=128, temperature=0,
    )  # fmt: skip
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1, first.output
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert (call.id or "").startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}],
        tools=[WEATHER],
        max_output_tokens=8,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # The continuation ran where the first turn's prefix was cached (the router follows the prompt).
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 2


def test_streamed_function_calls_are_assembled_by_the_sdk(client: OpenAI) -> None:
    with client.responses.stream(
        model=ADAPTER,
        input="Weather?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=128,
        temperature=0,
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert kinds.index("response.function_call_arguments.done") < kinds.index("response.completed")
    (call,) = [item for item in final.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_stored_responses_are_retrieved_listed_deleted_and_private(
    serve_app: ServeApp, client: OpenAI, other: OpenAI, tenant: tuple[str, str]
) -> None:
    made = client.responses.create(
        model=MODEL,
        input=[
            {"role": "developer", "content": "Answer in French."},
            {"role": "user", "content": [{"type": "input_text", "text": "Bonjour"}]},
        ],
        max_output_tokens=4,
    )
    assert client.responses.retrieve(made.id).model_dump() == made.model_dump()
    items = client.responses.input_items.list(made.id, order="asc")
    assert [(i.type, getattr(i, "role", None)) for i in items.data] == [
        ("message", "developer"),
        ("message", "user"),
    ]
    # Another tenant: exactly what a missing id gets, for reads, deletes and continuations.
    missing = f"resp_{uuid.uuid4().hex}"
    answers = []
    for response_id in (made.id, missing):
        for call in (
            lambda r=response_id: other.responses.retrieve(r),
            lambda r=response_id: other.responses.delete(r),
            lambda r=response_id: other.responses.create(model=MODEL, input="hi", previous_response_id=r),
        ):
            with pytest.raises(NotFoundError) as raised:
                call()
            assert isinstance(raised.value.body, dict)
            body = dict(raised.value.body)
            body["message"] = body["message"].replace(response_id, "ID")
            answers.append(body)
    assert answers[:3] == answers[3:]
    unstored = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(unstored.id)
    client.responses.delete(made.id)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(made.id)
    # A disabled tenant's stored responses go with it.
    kept = client.responses.create(model=MODEL, input="keep", max_output_tokens=2)
    tenant_id, key = serve_app.new_tenant(f"responses-gone-{uuid.uuid4().hex[:8]}")
    gone = OpenAI(base_url=f"{serve_app.url}/v1", api_key=key, max_retries=0, timeout=60)
    doomed = gone.responses.create(model=MODEL, input="soon gone", max_output_tokens=2)
    with serve_app.admin() as admin:
        assert admin.delete(f"/admin/tenants/{tenant_id}").status_code == 200
    with serve_app.sessions()() as s:
        assert s.get(StoredResponse, doomed.id) is None
        assert s.get(StoredResponse, kept.id) is not None


def test_truncation_auto_drops_old_turns_and_disabled_refuses(serve_app: ServeApp, client: OpenAI) -> None:
    card = next(m for m in client.models.list().data if m.id == MODEL)
    context = int((card.model_extra or {})["max_model_len"])

    def tokens(words: int) -> int:
        probe = client.responses.create(
            model=MODEL, input=" ".join(["sea"] * words), max_output_tokens=1, store=False
        )
        assert probe.usage is not None
        return probe.usage.input_tokens

    base, per_word = tokens(10), (tokens(110) - tokens(10)) / 100
    long = " ".join(["sea"] * int((context * 0.55 - base) / per_word))
    first = client.responses.create(model=MODEL, input=long, max_output_tokens=2)
    with pytest.raises(BadRequestError) as refused:
        client.responses.create(model=MODEL, input=long, previous_response_id=first.id, max_output_tokens=2)
    assert refused.value.body["param"] == "input"  # type: ignore[index]
    assert refused.value.body["code"] == "context_length_exceeded"  # type: ignore[index]
    second = client.responses.create(
        model=MODEL, input=long, previous_response_id=first.id, truncation="auto", max_output_tokens=2
    )
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens < first.usage.input_tokens + 16  # the first turn was dropped
    assert [i.id for i in client.responses.input_items.list(second.id).data]  # its own input is kept


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}
                ]
            },
            "input",
        ),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "hi", "background": True}, "background"),
        (
            {"input": [{"type": "reasoning", "summary": [], "content": "x"}]},
            "input",
        ),  # reasoning items are read
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": "hi", "modalities": ["text"]}, "modalities"),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_its_field(
    serve_app: ServeApp, tenant: tuple[str, str], fields: dict[str, Any], param: str
) -> None:
    headers = {"authorization": f"Bearer {tenant[1]}"}
    reply = httpx.post(
        f"{serve_app.url}/v1/responses", json={"model": MODEL, **fields}, headers=headers, timeout=30
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"].startswith(param), error


def test_every_response_is_billed_once_a_left_stream_too(
    serve_app: ServeApp, client: OpenAI, tenant: tuple[str, str]
) -> None:
    made = [client.responses.create(model=MODEL, input=f"count {i}", max_output_tokens=3) for i in range(3)]
    headers = {"authorization": f"Bearer {tenant[1]}"}
    # Greedy on this adapter runs all 400 tokens for this prompt (tests/e2e/test_adapters_e2e.py): the
    # client leaves long before the end.
    body = {
        "model": ADAPTER,
        "input": "tell me a long story",
        "max_output_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{serve_app.url}/v1/responses", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        events = (json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: "))
        left = next(events)["response"]["id"]  # response.created; then leave at the first text
        assert any(e["type"] == "response.output_text.delta" for e in events)
    rows = {row.request_id: row for row in usage_rows(serve_app, [*(m.id for m in made), left])}
    for response in made:
        row = rows[f"req_{response.id[5:]}"]
        assert response.usage is not None and row.status == "completed"
        assert (row.prompt_tokens, row.completion_tokens) == (
            response.usage.input_tokens,
            response.usage.output_tokens,
        )
    aborted = rows[f"req_{left[5:]}"]
    assert aborted.status == "aborted" and 1 <= aborted.completion_tokens < 400


def engine_replicas(model: str) -> dict[str, str]:
    """The model's engine replica actors: name -> namespace."""
    actors = ray.util.list_named_actors(all_namespaces=True)
    return {a["name"]: a["namespace"] for a in actors if f"#engine-{model}#" in a["name"]}


def test_a_stream_whose_replica_is_killed_ends_failed_and_is_billed_once(serve_app: ServeApp) -> None:
    """A real failure mid-stream: the engine replica generating the response is killed (tiny-qwen2's, so
    this module's other tests keep theirs). The client has text already, so nothing is retried: the stream
    ends with `error` and `response.failed` in OpenAI's shape, and what ran is billed once, as failed."""
    model = "tiny-qwen2"
    victims = engine_replicas(model)
    assert victims
    _, key = serve_app.new_tenant(f"responses-killed-{uuid.uuid4().hex[:8]}", tier="enterprise")
    # ignore_eos: the random model cannot end the stream between the kill and its taking effect.
    body = {
        "model": model,
        "input": "a long one",
        "max_output_tokens": 900,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {key}"}
    events: list[dict[str, Any]] = []
    kinds: list[str] = []
    with httpx.stream("POST", f"{serve_app.url}/v1/responses", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(json.loads(line[6:]))
            kinds.append(events[-1]["type"])
            if kinds == STREAM_ORDER[:5]:
                for name, namespace in victims.items():  # the first text is out: kill what makes it
                    ray.kill(ray.get_actor(name, namespace=namespace))
    deltas = kinds.count("response.output_text.delta")
    assert kinds[:5] == STREAM_ORDER[:5] and deltas < 900, kinds[-3:]
    assert kinds[-2:] == ["error", "response.failed"], kinds[-3:]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    error, failed = events[-2], events[-1]["response"]
    assert set(error) == {"type", "code", "message", "param", "sequence_number"}, error
    assert error["code"] == "engine_unavailable" and "retry the request" in error["message"]
    assert failed["status"] == "failed" and failed["error"] == {
        "code": error["code"],
        "message": error["message"],
    }
    for leak in ("#engine", "Traceback", "ActorDiedError", "ray", *victims):
        assert leak not in error["message"], error["message"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    (item,) = failed["output"]  # what the client saw, kept in the failed response, marked unfinished
    assert item["status"] == "incomplete" and item["content"][0]["text"] == text
    (row,) = usage_rows(serve_app, [failed["id"]])
    assert row.status == "failed" and row.completion_tokens >= deltas
    deadline = time.monotonic() + 120  # Serve replaces the replica; the next modules use it
    while set(engine_replicas(model)) & set(victims) or len(engine_replicas(model)) < len(victims):
        assert time.monotonic() < deadline, "Serve did not replace the killed replica"
        time.sleep(0.5)
    time.sleep(2)  # nothing bills the failed response a second time
    assert len(usage_rows(serve_app, [failed["id"]], timeout=0)) == 1
    short = {**body, "stream": False, "max_output_tokens": 4}
    again = httpx.post(f"{serve_app.url}/v1/responses", json=short, headers=headers, timeout=120)
    assert again.status_code == 200 and again.json()["status"] == "incomplete", again.text
