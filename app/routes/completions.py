"""POST /v1/chat/completions and /v1/completions.

Prompt size is bounded before any work (Settings.max_messages, max_prompt_chars), and templating and
tokenisation run in the thread pool: a large prompt never holds the event loop other requests share.
"""

from fastapi import APIRouter
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from app.deps import RequestIdDep, ServicesDep, TenantDep
from app.errors import InvalidParameter
from app.generation import Generation, sampling_params
from app.routes.guarded import TenantRoute
from app.schemas.openai import ChatCompletionRequest, CompletionRequest
from app.settings import Settings

router = APIRouter(prefix="/v1", tags=["inference"], route_class=TenantRoute)


def _check_prompt_size(settings: Settings, param: str, texts: list[str]) -> None:
    chars = sum(len(t) for t in texts)
    if chars > settings.max_prompt_chars:
        message = f"The prompt has {chars:,} characters; at most {settings.max_prompt_chars:,} are accepted."
        raise InvalidParameter(message, param=param, code="prompt_too_large")


@router.post("/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, principal: TenantDep, services: ServicesDep, request_id: RequestIdDep
) -> JSONResponse | StreamingResponse:
    limit = services.settings.max_messages
    if len(body.messages) > limit:
        message = f"{len(body.messages):,} messages were sent; at most {limit:,} are accepted."
        raise InvalidParameter(message, param="messages", code="too_many_messages")
    _check_prompt_size(services.settings, "messages", [m.text() for m in body.messages])
    target = await services.resolve(principal, body.model)
    prompt_ids = await run_in_threadpool(target.base.prompts.chat, body.messages)
    generation = Generation.begin(services, principal, target, request_id, "chat", body)
    return await generation.respond(prompt_ids, sampling_params(body, body.output_limit))


@router.post("/completions", response_model=None)
async def completions(
    body: CompletionRequest, principal: TenantDep, services: ServicesDep, request_id: RequestIdDep
) -> JSONResponse | StreamingResponse:
    if isinstance(body.prompt, str):
        _check_prompt_size(services.settings, "prompt", [body.prompt])
    target = await services.resolve(principal, body.model)
    prompt_ids = await run_in_threadpool(target.base.prompts.completion, body.prompt)
    generation = Generation.begin(services, principal, target, request_id, "completion", body)
    return await generation.respond(prompt_ids, sampling_params(body, body.output_limit))
