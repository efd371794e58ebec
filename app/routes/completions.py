"""POST /v1/chat/completions and /v1/completions: each body planned (app/completions/plan.py), run
through the request lifecycle and answered in its API's shape."""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from app.completions.chat_renderer import ChatRenderer
from app.completions.completion_renderer import CompletionRenderer
from app.completions.delivery import respond
from app.completions.lifecycle import RequestLifecycle
from app.completions.plan import plan_chat, plan_completion
from app.route_guards import BEARER_HEADER, TenantRoute, admits, tenant_call
from app.schemas.openai import ChatCompletionRequest, CompletionRequest, SamplingFields

router = APIRouter(prefix="/v1", tags=["inference"], route_class=TenantRoute)


def _usage_options(body: SamplingFields) -> dict[str, bool]:
    options = body.stream_options
    return {
        "include_usage": bool(options and options.include_usage),
        "continuous_usage": bool(options and options.continuous_usage_stats),
    }


@router.post("/chat/completions", response_model=None, openapi_extra=BEARER_HEADER)
@admits
async def chat_completions(body: ChatCompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    call = tenant_call(request)
    plan = await plan_chat(body, call.principal, call.services)
    life = RequestLifecycle.begin(call.services, call.principal, plan, call.request_id, stream=body.stream)
    renderer = ChatRenderer.for_plan(call.request_id, plan, **_usage_options(body))
    return await respond(life, renderer, stream=body.stream)


@router.post("/completions", response_model=None, openapi_extra=BEARER_HEADER)
@admits
async def completions(body: CompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    call = tenant_call(request)
    plan = await plan_completion(body, call.principal, call.services)
    life = RequestLifecycle.begin(call.services, call.principal, plan, call.request_id, stream=body.stream)
    renderer = CompletionRenderer.for_plan(call.request_id, plan, **_usage_options(body))
    return await respond(life, renderer, stream=body.stream)
