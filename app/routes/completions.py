"""POST /v1/chat/completions and /v1/completions.

Prompt size is bounded before any work (Settings.max_messages, max_prompt_chars, max_prompts; a token id
counts as a character), and templating and tokenisation run in the thread pool: a large prompt never
holds the event loop other requests share. What the engine is asked beyond sampling (n, logprobs,
logit_bias, structured output for response_format and tool_choice) is read here;
app/completions/choices.py shapes what comes back.
"""

import json
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from app.completions import tool_calls
from app.completions.choices import Shape
from app.completions.generation import Generation
from app.completions.prompts import PromptBuilder
from app.deps import RequestIdDep, ServicesDep, TenantDep
from app.errors import InvalidParameter
from app.routes.guarded import TenantRoute
from app.schemas.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormat,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
    SamplingFields,
)
from app.settings import Settings
from deployments.engine.interface import SamplingParams, StructuredOutput

router = APIRouter(prefix="/v1", tags=["inference"], route_class=TenantRoute)
ANY_OBJECT = '{"type": "object"}'


def sampling_params(body: SamplingFields, max_tokens: int | None, **more: Any) -> SamplingParams:
    """OpenAI defaults where the request is silent (temperature 1, top_p 1); `more` sets the rest (n,
    logprobs, logit_bias, structured output), which each route reads from its own fields."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        seed=body.seed,
        stop=tuple(body.stop_list),
        **more,
    )


def _check_prompt_size(settings: Settings, param: str, sizes: list[int], unit: str = "characters") -> None:
    """Text is bounded by its characters; token ids meet the same bound, an id for a character (a token
    is at least one character of text, so ids never buy a longer prompt than text could)."""
    chars = sum(sizes)
    if chars > settings.max_prompt_chars:
        message = f"The prompt has {chars:,} {unit}; at most {settings.max_prompt_chars:,} are accepted."
        raise InvalidParameter(message, param=param, code="prompt_too_large")


def _check_n(settings: Settings, n: int) -> None:
    if n > settings.max_n:
        raise InvalidParameter(
            f"n is {n}; at most {settings.max_n} choices are served per prompt.", param="n"
        )


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's token id -> bias map, checked against the base model's tokenizer."""
    entries = []
    for key, value in (bias or {}).items():
        token = int(key) if key.isascii() and key.isdigit() and len(key) <= 12 else -1
        if not 0 <= token < vocab_size:
            message = f"logit_bias keys must be token ids from 0 to {vocab_size - 1}; got {key[:32]!r}"
            raise InvalidParameter(message, param="logit_bias")
        entries.append((token, float(value)))
    return tuple(sorted(entries))


def _response_format(response_format: ResponseFormat | None) -> StructuredOutput | None:
    if isinstance(response_format, ResponseFormatJsonObject):
        return StructuredOutput(json_schema=ANY_OBJECT, param="response_format")
    if isinstance(response_format, ResponseFormatJsonSchema):
        schema = response_format.json_schema.schema_
        text = ANY_OBJECT if schema is None else json.dumps(schema, ensure_ascii=False)
        return StructuredOutput(json_schema=text, param="response_format")
    return None


@router.post("/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, principal: TenantDep, services: ServicesDep, request_id: RequestIdDep
) -> JSONResponse | StreamingResponse:
    settings = services.settings
    limit = settings.max_messages
    if len(body.messages) > limit:
        message = f"{len(body.messages):,} messages were sent; at most {limit:,} are accepted."
        raise InvalidParameter(message, param="messages", code="too_many_messages")
    _check_prompt_size(settings, "messages", [m.size() for m in body.messages])
    _check_n(settings, body.n)
    tools = tool_calls.plan(body)
    target = await services.resolve(principal, body.model)
    logit_bias = _logit_bias(body.logit_bias, target.base.prompts.vocab_size)
    prompt_ids = await run_in_threadpool(target.base.prompts.chat, body.messages, tools.tools)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(
        body,
        body.output_limit,
        n=body.n,
        logprobs=logprobs,
        logit_bias=logit_bias,
        structured=tools.structured or _response_format(body.response_format),
    )
    generation = Generation.begin(services, principal, target, request_id, "chat", body)
    shape = Shape(n=body.n, logprobs=logprobs, tool_names=tools.names)
    return await generation.respond([prompt_ids], params, shape)


def _echoes(prompts: PromptBuilder, texts: list[str] | list[list[int]]) -> tuple[str, ...]:
    return tuple(p if isinstance(p, str) else prompts.decode(p) for p in texts)


@router.post("/completions", response_model=None)
async def completions(
    body: CompletionRequest, principal: TenantDep, services: ServicesDep, request_id: RequestIdDep
) -> JSONResponse | StreamingResponse:
    settings = services.settings
    texts = body.prompts
    if len(texts) > settings.max_prompts:
        message = f"{len(texts):,} prompts were sent; at most {settings.max_prompts:,} are accepted."
        raise InvalidParameter(message, param="prompt", code="too_many_prompts")
    unit = "characters" if isinstance(texts[0], str) else "token ids"
    _check_prompt_size(settings, "prompt", [len(p) for p in texts], unit)
    _check_n(settings, body.n)
    if body.max_tokens == 0 and not body.echo:
        message = "max_tokens may be 0 only with echo (for the prompt's log-probabilities)."
        raise InvalidParameter(message, param="max_tokens")
    target = await services.resolve(principal, body.model)
    prompts = target.base.prompts
    logit_bias = _logit_bias(body.logit_bias, prompts.vocab_size)
    prompt_ids = await run_in_threadpool(prompts.completions, texts)
    echo = await run_in_threadpool(_echoes, prompts, texts) if body.echo else None
    prompt_logprobs = None
    if body.echo and (body.logprobs is not None or body.max_tokens == 0):
        prompt_logprobs = body.logprobs or 0  # max_tokens 0 asks for the prompt's logprobs alone
    params = sampling_params(
        body,
        body.output_limit,
        n=body.n,
        logprobs=body.logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=logit_bias,
        structured=_response_format(body.response_format),
    )
    generation = Generation.begin(services, principal, target, request_id, "completion", body)
    shape = Shape(n=body.n, logprobs=body.logprobs, echo=echo)
    return await generation.respond(prompt_ids, params, shape)
