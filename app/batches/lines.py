"""LineCheck: one line of a batch input file against the batch's endpoint, as the interactive routes would
take its body: `{"custom_id", "method": "POST", "url": <the batch's endpoint>, "body"}`, the body valid for
the endpoint's request schema (the same pydantic models as the routes), not streamed, and for /v1/responses
neither stored nor chained (a batch line's response is its output line, not a stored response). Whether its
`model` is one the tenant may use is asked once per distinct model (app/batches/validation.py).

Each line's request id is fixed by its batch and custom_id (`line_request_id`), so a line that runs twice is
metered once (usage rows are keyed by request id).
"""

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from app.responses.request import ResponseRequest
from app.schemas.openai import ChatCompletionRequest, CompletionRequest
from billing.models.batch_line import PREFIX_CHARS

MAX_CUSTOM_ID_CHARS = 512
SCHEMAS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponseRequest,
}


def prompt_prefix(body: dict[str, Any]) -> str:
    """The opening of a line's prompt, as sent (chat messages, a completion's prompt, a response's
    instructions and input), PREFIX_CHARS long: lines are claimed in its order within a model, so lines that
    share a prompt's start sit together and run together, and the prefix cache prefills that start once."""
    if "messages" in body:
        prompt: Any = body["messages"]
    elif "prompt" in body:
        prompt = body["prompt"]
    else:
        prompt = [body.get("instructions"), body.get("input")]
    return json.dumps(prompt, ensure_ascii=False, separators=(",", ":"))[:PREFIX_CHARS]


def line_request_id(batch_id: str, custom_id: str) -> str:
    """The request id of a batch's line: the same for every run of it, and nobody else's."""
    return "req_" + hashlib.sha256(f"{batch_id}\n{custom_id}".encode()).hexdigest()[:32]


@dataclass(frozen=True)
class LineError:
    """One entry of a failed batch's `errors` (OpenAI's BatchError)."""

    line: int
    code: str
    message: str
    param: str | None = None

    def to_api(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass(frozen=True)
class Request:
    """A line that passed: what the batch stores of it."""

    line: int
    custom_id: str
    model: str
    body: dict[str, Any]


class LineCheck:
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.schema = SCHEMAS[endpoint]

    def check(self, number: int, raw: bytes) -> Request | LineError:
        try:
            value = json.loads(raw)
        except ValueError:
            return LineError(number, "invalid_json_line", f"Line {number} is not valid JSON.")
        if not isinstance(value, dict):
            return LineError(number, "invalid_json_line", f"Line {number} is not a JSON object.")
        custom_id = value.get("custom_id")
        if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= MAX_CUSTOM_ID_CHARS:
            message = f"custom_id must be a string of 1 to {MAX_CUSTOM_ID_CHARS} characters."
            return LineError(number, "invalid_custom_id", message, "custom_id")
        if value.get("method") != "POST":
            return LineError(number, "invalid_method", 'method must be "POST".', "method")
        if value.get("url") != self.endpoint:
            message = f"url must be the batch's endpoint, {self.endpoint}."
            return LineError(number, "mismatched_url", message, "url")
        body = value.get("body")
        if not isinstance(body, dict):
            return LineError(number, "invalid_body", "body must be a JSON object: the request.", "body")
        refused = self._refused(number, body)
        if refused is not None:
            return refused
        try:
            self.schema.model_validate(body)
        except ValidationError as error:
            return _invalid(number, error)
        return Request(number, custom_id, str(body["model"]), body)  # a string: the schema requires one

    def _refused(self, number: int, body: dict[str, Any]) -> LineError | None:
        """What a batch line may not ask for, though the interactive endpoint takes it."""
        if body.get("stream") is True:
            return LineError(number, "stream_not_supported", "A batch line cannot stream.", "body.stream")
        if self.endpoint != "/v1/responses":
            return None
        if body.get("store") is True:
            message = "A batch line's response is not stored: send store false or leave it out."
            return LineError(number, "store_not_supported", message, "body.store")
        if body.get("previous_response_id") is not None:
            message = "A batch line cannot continue a stored response (previous_response_id)."
            return LineError(number, "previous_response_not_supported", message, "body.previous_response_id")
        return None


def _invalid(number: int, error: ValidationError) -> LineError:
    first = error.errors()[0]
    loc = ".".join(str(part) for part in first.get("loc", ()))
    param = f"body.{loc}" if loc else "body"
    if first.get("type") == "extra_forbidden":
        return LineError(number, "invalid_body", f"Unrecognized request argument supplied: {param}", param)
    return LineError(number, "invalid_body", f"{param}: {first.get('msg', 'invalid value')}", param)
