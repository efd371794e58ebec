"""POST /v1/chat/completions and /v1/completions."""

from fastapi import APIRouter
from fastapi.responses import JSONResponse, StreamingResponse

from app.deps import RequestIdDep, ServicesDep, TenantDep
from app.generation import Generation, sampling_params
from app.routes.guarded import TenantRoute
from app.schemas.openai import ChatCompletionRequest, CompletionRequest

router = APIRouter(prefix="/v1", tags=["inference"], route_class=TenantRoute)


@router.post("/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, principal: TenantDep, services: ServicesDep, request_id: RequestIdDep
) -> JSONResponse | StreamingResponse:
    target = await services.resolve(principal, body.model)
    prompt_ids = target.base.prompts.chat(body.messages)
    generation = Generation.begin(services, principal, target, request_id, "chat", body)
    return await generation.respond(prompt_ids, sampling_params(body, body.output_limit))


@router.post("/completions", response_model=None)
async def completions(
    body: CompletionRequest, principal: TenantDep, services: ServicesDep, request_id: RequestIdDep
) -> JSONResponse | StreamingResponse:
    target = await services.resolve(principal, body.model)
    prompt_ids = target.base.prompts.completion(body.prompt)
    generation = Generation.begin(services, principal, target, request_id, "completion", body)
    return await generation.respond(prompt_ids, sampling_params(body, body.output_limit))
