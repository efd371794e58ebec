"""The Open Responses compliance cases (openresponses/openresponses, src/lib/compliance-tests.ts at
0cb939c: basic, streaming, system prompt, tool calling, tool calling streamed, image input, multi-turn), sent
as its runner sends them (raw JSON to POST /v1/responses, `stream` true or false) and checked the way it
checks them: the final response object has every field the specification requires, each stream event has
the fields its event type requires, and each case's own checks hold.

Their runner cannot run here (its repository has no snapshot for this machine, and the runner needs its
generated zod schemas and bun), so the specification's required-field lists are restated below; they are
facts of the spec, not its code. Deviations, each stated: the tool-calling cases force the call with
`tool_choice: "required"` (the tiny test model is random; the case sends `auto` and expects the model to
choose the tool, a property of the model, not of the server), and image input is a 400 naming the field
(the served models read text; the issue asks for exactly that, never a silent drop).
"""

import json
from typing import Any

import httpx
import pytest

from tests.app.conftest import MODEL, Served

# ResponseResource.json's "required", and each field's JSON type(s).
RESPONSE_FIELDS: dict[str, tuple[type | None, ...]] = {
    "id": (str,), "object": (str,), "created_at": (int,), "completed_at": (int, None), "status": (str,),
    "incomplete_details": (dict, None), "model": (str,), "previous_response_id": (str, None),
    "instructions": (str, list, None), "output": (list,), "error": (dict, None), "tools": (list,),
    "tool_choice": (str, dict), "truncation": (str,), "parallel_tool_calls": (bool,), "text": (dict,),
    "top_p": (float, int), "presence_penalty": (float, int), "frequency_penalty": (float, int),
    "top_logprobs": (int,), "temperature": (float, int), "reasoning": (dict, None), "user": (str, None),
    "usage": (dict, None), "max_output_tokens": (int, None), "max_tool_calls": (int, None),
    "store": (bool,), "background": (bool,), "service_tier": (str,), "metadata": (dict,),
    "safety_identifier": (str, None), "prompt_cache_key": (str, None),
}  # fmt: skip
# The streaming event schemas' "required", for the event types a text model's stream has.
EVENT_FIELDS: dict[str, set[str]] = {
    "response.created": {"response"},
    "response.in_progress": {"response"},
    "response.completed": {"response"},
    "response.incomplete": {"response"},
    "response.failed": {"response"},
    "response.output_item.added": {"output_index", "item"},
    "response.output_item.done": {"output_index", "item"},
    "response.content_part.added": {"item_id", "output_index", "content_index", "part"},
    "response.content_part.done": {"item_id", "output_index", "content_index", "part"},
    "response.output_text.delta": {"item_id", "output_index", "content_index", "delta", "logprobs"},
    "response.output_text.done": {"item_id", "output_index", "content_index", "text", "logprobs"},
    "response.function_call_arguments.delta": {"item_id", "output_index", "delta"},
    "response.function_call_arguments.done": {"item_id", "output_index", "arguments"},
}
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather for a location",
    "parameters": {
        "type": "object",
        "properties": {"location": {"type": "string", "description": "The city and state"}},
        "required": ["location"],
    },
}
CASES: dict[str, dict[str, Any]] = {
    "basic-response": {"input": [{"type": "message", "role": "user", "content": "Say hello in 3 words."}]},
    "streaming-response": {
        "input": [{"type": "message", "role": "user", "content": "Count from 1 to 5."}],
        "stream": True,
    },
    "system-prompt": {
        "input": [
            {"type": "message", "role": "system", "content": "You are a pirate."},
            {"type": "message", "role": "user", "content": "Say hello."},
        ]
    },
    "tool-calling": {
        "input": [{"type": "message", "role": "user", "content": "What's the weather in San Francisco?"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": "required",
    },
    "tool-calling-streaming": {
        "input": [{"type": "message", "role": "user", "content": "What's the weather in San Francisco?"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": "required",
        "stream": True,
    },
    "multi-turn": {
        "input": [
            {"type": "message", "role": "user", "content": "My name is Alice."},
            {"type": "message", "role": "assistant", "content": "Hello Alice! How can I help?"},
            {"type": "message", "role": "user", "content": "What is my name?"},
        ]
    },
}


def assert_response_resource(response: dict[str, Any]) -> None:
    missing = set(RESPONSE_FIELDS) - set(response)
    assert not missing, f"required fields missing: {sorted(missing)}"
    for name, kinds in RESPONSE_FIELDS.items():
        value = response[name]
        allowed = tuple(type(None) if k is None else k for k in kinds)
        not_a_number = not (isinstance(value, bool) and bool not in kinds)  # JSON true is no integer
        assert isinstance(value, allowed) and not_a_number, (name, value)
    assert response["object"] == "response"


def read_stream(response: httpx.Response) -> list[dict[str, Any]]:
    """SSE as their parser reads it: `event:` and `data:` lines, a blank line ends an event."""
    events, name, data = [], "", ""
    for line in response.iter_lines():
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data = line[5:].strip()
        elif line == "" and data:
            if data != "[DONE]":
                payload = json.loads(data)
                assert name in ("", payload["type"]), (name, payload["type"])
                events.append(payload)
            name, data = "", ""
    return events


def assert_events(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Each event has its type's required fields and the sequence numbers count up from 0; returns the
    final response (from response.completed / incomplete / failed)."""
    assert events, "no streaming events"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        required = EVENT_FIELDS.get(event["type"])
        assert required is not None, f"an event type outside the specification: {event['type']}"
        assert required <= set(event), (event["type"], sorted(required - set(event)))
    final = [
        e for e in events if e["type"] in {"response.completed", "response.incomplete", "response.failed"}
    ]
    assert len(final) == 1 and events[-1] is final[0]
    return final[0]["response"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("case", list(CASES))
def test_the_open_responses_case(served: Served, case: str) -> None:
    _, key = served.new_tenant(f"compliance-{case}")
    body = {"model": MODEL, "max_output_tokens": 48, "temperature": 0, **CASES[case]}
    headers = {"authorization": f"Bearer {key}"}
    with httpx.stream("POST", f"{served.url}/v1/responses", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        if body.get("stream"):
            events = read_stream(r)
            response = assert_events(events)
        else:
            response = json.loads(r.read())
    assert_response_resource(response)
    assert response["output"], "no output items"
    if case.startswith("tool-calling"):
        assert response["status"] == "completed" and response["completed_at"] >= response["created_at"]
        assert any(item["type"] == "function_call" for item in response["output"])
        if body.get("stream"):
            kinds = [(e["type"], e.get("item", {}).get("type")) for e in events]
            assert ("response.output_item.added", "function_call") in kinds
            assert ("response.output_item.done", "function_call") in kinds
            assert {"response.function_call_arguments.delta", "response.function_call_arguments.done"} <= {
                e["type"] for e in events
            }
    else:  # a random model may run to max_output_tokens: "incomplete" then, with its reason
        assert response["status"] in ("completed", "incomplete")
        if response["status"] == "incomplete":
            assert response["incomplete_details"] == {"reason": "max_output_tokens"}
            assert response["completed_at"] is None


def test_image_input_is_refused_naming_the_field(served: Served) -> None:
    _, key = served.new_tenant("compliance-image")
    image = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}
    body = {
        "model": MODEL,
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "?"}, image]}
        ],
    }
    r = httpx.post(f"{served.url}/v1/responses", json=body, headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "input" in (error["param"] or "")
    assert "image" in error["message"]
