"""run_line: one batch line through the same request lifecycle as its endpoint's HTTP route, without HTTP:
planned as the route plans it, admitted (its money held, not the interactive rate limits), in the engine's
`batch` class, under the line's fixed request id, and answered with the status and JSON body the route
would have sent. A /v1/responses line runs with store false (its output line is its response).
"""

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from app.auth.authenticator import Principal
from app.batches.leases import Claimed
from app.batches.lines import SCHEMAS
from app.completions.chat_renderer import ChatRenderer
from app.completions.completion_renderer import CompletionRenderer
from app.completions.delivery import whole_body
from app.completions.lifecycle import RequestLifecycle
from app.completions.plan import plan_chat, plan_completion
from app.completions.rendering import Renderer
from app.errors import APIError, InvalidParameter, to_api_error
from app.responses.request import ResponseRequest
from app.responses.routes import prepare, responses_param
from app.schemas.openai import ChatCompletionRequest, CompletionRequest
from app.services import Services

NO_USAGE_STREAM = {"include_usage": False, "continuous_usage": False}


@dataclass(frozen=True)
class Answer:
    """What the route would have answered: its status and JSON body."""

    status_code: int
    body: dict[str, Any]
    code: str | None = None  # an error's code

    @property
    def ok(self) -> bool:
        return self.status_code == 200


async def run_line(services: Services, principal: Principal, line: Claimed) -> Answer:
    endpoint = line.endpoint
    try:
        return Answer(200, await _run(services, principal, line))
    except ValidationError as invalid:  # validated at create: only a schema changed since says this
        first = invalid.errors()[0]
        param = ".".join(str(part) for part in first.get("loc", ())) or None
        error: APIError = InvalidParameter(f"{param}: {first.get('msg', 'invalid value')}", param=param)
    except Exception as failure:
        error = to_api_error(failure)
    if endpoint == "/v1/responses":
        error = responses_param(error)
    return Answer(error.status, error.body(), error.code)


async def _run(services: Services, principal: Principal, line: Claimed) -> dict[str, Any]:
    endpoint, body, request_id = line.endpoint, line.body, line.request_id
    life: RequestLifecycle
    renderer: Renderer
    if endpoint == "/v1/responses":
        request = ResponseRequest.model_validate({**body, "store": False})
        life, renderer = await prepare(request, principal, services, request_id, "batch")
    elif endpoint == "/v1/chat/completions":
        chat = SCHEMAS[endpoint].model_validate(body)
        assert isinstance(chat, ChatCompletionRequest)
        plan = await plan_chat(chat, principal, services)
        life = RequestLifecycle.begin(services, principal, plan, request_id, stream=False, priority="batch")
        renderer = ChatRenderer.for_plan(request_id, plan, **NO_USAGE_STREAM)
    else:
        completion = SCHEMAS[endpoint].model_validate(body)
        assert isinstance(completion, CompletionRequest)
        plan = await plan_completion(completion, principal, services)
        life = RequestLifecycle.begin(services, principal, plan, request_id, stream=False, priority="batch")
        renderer = CompletionRenderer.for_plan(request_id, plan, **NO_USAGE_STREAM)
    life.batch_id = line.batch_id  # its usage row says which batch it was
    return await whole_body(life, renderer)
