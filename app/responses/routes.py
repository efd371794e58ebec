"""POST /v1/responses, and GET / DELETE /v1/responses/{id} and GET /v1/responses/{id}/input_items.

Creating a response is planned as a chat request (app/completions/plan.plan_chat): the same bounds, tools,
grammar, rate limits and metering; errors that chat would name by its fields name the Responses fields.
It runs through the same request lifecycle, rendered by app/responses/renderer.py.
A continuation (`previous_response_id`) reads its chain from the store (walking its predecessors; it is
stored by reference to the one it continues) and, with truncation 'auto', drops
its oldest turns until the prompt leaves room for the output (and, when stored, fits max_stored_kb).
"""

import json
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from app.auth.authenticator import Principal
from app.completions.delivery import respond
from app.completions.engine_stream import uncancellable
from app.completions.lifecycle import RequestLifecycle
from app.completions.plan import RequestPlan, plan_chat
from app.deps import ReaderDep, ServicesDep
from app.errors import APIError, InvalidParameter, NotFound, StorageQuotaExceeded
from app.responses.conversation import PARAMS, Conversation, with_ids
from app.responses.objects import ResponseObject
from app.responses.renderer import ResponsesRenderer
from app.responses.request import ResponseRequest
from app.responses.store import MAX_DEPTH, ResponseStore, Stored
from app.route_guards import BEARER_HEADER, TenantRoute, admits, tenant_call
from app.services import Services
from app.settings import Settings
from app.storage import ByteKeeper, stored_bytes
from deployments.engine.interface import Priority

router = APIRouter(prefix="/v1", tags=["responses"], route_class=TenantRoute)
# The storage hold's estimate of a stored row's growth past the response as created: its end (status,
# usage, the message and reasoning items around the text) and each output token's text as stored JSON (a
# token is a few characters; a non-ASCII one is escaped). An output past the estimate is stored anyway.
ENDED_BYTES = 1024
OUTPUT_BYTES_PER_TOKEN = 16


def _store(services: Services) -> ResponseStore:
    return ResponseStore(services.session_factory, services.settings.responses)


def _missing(response_id: str, param: str | None = None) -> NotFound:
    """The same answer for an id that never existed, expired, was deleted or is another tenant's."""
    return NotFound(f"No response with id '{response_id[:64]}' was found.", param=param)


@router.post("/responses", response_model=None, openapi_extra=BEARER_HEADER)
@admits
async def create_response(body: ResponseRequest, request: Request) -> JSONResponse | StreamingResponse:
    call = tenant_call(request)
    try:
        return await _create(body, call.principal, call.services, call.request_id)
    except APIError as error:
        raise responses_param(error) from None


def responses_param(error: APIError) -> APIError:
    """An error that names a chat field, renamed to the Responses field it came from."""
    error.param = PARAMS.get(error.param or "", error.param)
    return error


async def _create(
    body: ResponseRequest, principal: Principal, services: Services, request_id: str
) -> JSONResponse | StreamingResponse:
    life, renderer = await prepare(body, principal, services, request_id)
    try:
        return await respond(life, renderer, stream=body.stream)
    except BaseException:  # refused, failed or cancelled before a response existed: nothing will be stored
        await uncancellable(renderer.release())
        raise


async def prepare(
    body: ResponseRequest,
    principal: Principal,
    services: Services,
    request_id: str,
    priority: Priority = "interactive",
) -> tuple[RequestLifecycle, ResponsesRenderer]:
    """The response's request, planned and ready to run (the route's, and a Batch API line's); errors name
    chat's fields: `responses_param` renames them."""
    settings = services.settings
    if isinstance(body.input, list) and len(body.input) > settings.responses.max_input_items:
        message = f"input has {len(body.input):,} items; at most {settings.responses.max_input_items:,}"
        raise InvalidParameter(message, param="input", code="too_many_items")
    target = await services.resolve(principal, body.model)
    context_tokens = target.base.max_model_len
    if body.max_output_tokens is not None and body.max_output_tokens >= context_tokens:
        # Refused first: no prompt could leave it room, so no turn is read, dropped or templated for it.
        message = (
            f"max_output_tokens {body.max_output_tokens:,} leaves no room for a prompt in this model's "
            f"context of {context_tokens:,} tokens."
        )
        raise InvalidParameter(message, param="max_output_tokens", code="context_length_exceeded")
    store = _store(services)
    context: list[dict[str, Any]] = []
    previous: Stored | None = None
    if body.previous_response_id is not None:
        previous = await run_in_threadpool(
            store.get, principal.tenant_id, body.previous_response_id, None, True
        )
        if previous is None:
            raise _missing(body.previous_response_id, "previous_response_id")
        context = previous.chain()
    # A stored chain runs to max_stored_kb of JSON: sized, parsed and rendered off the event loop.
    conversation = await run_in_threadpool(
        _within_storage, settings, body, Conversation(context, with_ids(body.items()))
    )
    if body.store and principal.max_stored_response_bytes is not None:
        quota = principal.max_stored_response_bytes
        files = services.file_store()
        await run_in_threadpool(_within_quota, store, files, principal, quota, conversation, previous)
    chat_body = await run_in_threadpool(conversation.chat_request, body)
    plan = await plan_chat(chat_body, principal, services)
    if body.truncation == "auto" and conversation.context and _overflows(plan, body):
        # The chain is templated once whole, its items' text counted once, and the cut found by arithmetic;
        # the cut conversation is templated once more (and one turn more dropped only if the estimate fell
        # short). Dropping a turn at a time re-templated the whole chain for each.
        own = await _own_prompt(conversation, body, principal, services)
        excess = plan.longest_prompt + (body.max_output_tokens or 1) - context_tokens
        cut = await run_in_threadpool(
            conversation.cut_to_tokens, plan.longest_prompt, excess, own, plan.target.base.prompts.count
        )
        conversation = conversation.from_cut(cut)
        chat_body = await run_in_threadpool(conversation.chat_request, body)
        plan = await plan_chat(chat_body, principal, services)
    while body.truncation == "auto" and _overflows(plan, body):
        shorter = conversation.without_oldest_turn()
        if shorter is None:
            break  # the request's own input is too long: the context check refuses it, naming input
        conversation = shorter
        chat_body = await run_in_threadpool(conversation.chat_request, body)
        plan = await plan_chat(chat_body, principal, services)
    stream = body.stream
    life = RequestLifecycle.begin(services, principal, plan, request_id, stream=stream, priority=priority)
    renderer = ResponsesRenderer(
        _created(body, request_id),
        plan.shape,
        tenant_id=principal.tenant_id,
        conversation=conversation,
        store=store,
        previous=previous,
    )
    if body.store and principal.max_stored_response_bytes is not None:
        await _hold(renderer, plan, principal, principal.max_stored_response_bytes)
        life.at_close(renderer.closed)
    return life, renderer


def _overflows(plan: RequestPlan, body: ResponseRequest) -> bool:
    """Whether the prompt leaves no room for the output asked for (at least one token)."""
    return plan.longest_prompt + (body.max_output_tokens or 1) > plan.target.base.max_model_len


async def _own_prompt(
    conversation: Conversation, body: ResponseRequest, principal: Principal, services: Services
) -> int | None:
    """Tokens of the prompt without the chain (instructions, tools, this request's items); None when the
    template refuses them alone (a chain's turn cut estimates short without it, and the loop drops more)."""
    own = Conversation([], conversation.items)
    try:
        chat_body = await run_in_threadpool(own.chat_request, body)
        return (await plan_chat(chat_body, principal, services)).longest_prompt
    except APIError:
        return None


def _within_storage(settings: Settings, body: ResponseRequest, conversation: Conversation) -> Conversation:
    """A stored conversation is bounded (max_stored_kb): 'auto' drops old turns, 'disabled' is a 400.
    Each item is serialised once and the cut found by arithmetic (Conversation.cut_to_size)."""
    if not body.store:
        return conversation
    limit = settings.responses.max_stored_kb * 1024
    kept = conversation.cut_to_size(limit, drop=body.truncation == "auto")
    if kept is not None:
        return kept
    message = (
        f"This conversation would take more than {settings.responses.max_stored_kb:,} KB to store; "
        "send truncation 'auto' to drop its oldest turns, store false, or start a new one."
    )
    param = "previous_response_id" if conversation.context else "input"
    raise InvalidParameter(message, param=param, code="conversation_too_large")


def _within_quota(
    store: ResponseStore,
    files: ByteKeeper,
    principal: Principal,
    quota: int,
    conversation: Conversation,
    previous: Stored | None,
) -> None:
    """Refused before any work when the tenant's live stored responses and files (they share the quota)
    and what this response will store would pass its tier's quota: its own items (a continuation refers to
    its chain) or, when it stores its context itself, the whole conversation. A first check, without a
    lock: the storage hold taken once the request is planned (`_hold`) is the one that counts the output
    and the tenant's other requests in flight. Run in the thread pool (queries, and the items' size)."""
    used = stored_bytes(store, files, principal.tenant_id).total
    needed = _stored_items_size(conversation, previous)
    if used + needed > quota:
        raise StorageQuotaExceeded(used=used, needed=needed, quota=quota, tier=principal.tier)


async def _hold(renderer: ResponsesRenderer, plan: RequestPlan, principal: Principal, quota: int) -> None:
    """Hold what this response may store against the tenant's quota while it runs, or refuse it (403): the
    check above saw what was stored; this one also sees what the tenant's other requests in flight hold, in
    one transaction under the tenant's lock."""
    needed = await run_in_threadpool(_storage_estimate, renderer, plan)
    used = await run_in_threadpool(
        renderer.store.hold, principal.tenant_id, renderer.response.id, needed, quota
    )
    if used is not None:
        raise StorageQuotaExceeded(used=used, needed=needed, quota=quota, tier=principal.tier)
    renderer.held = True


def _stored_items_size(conversation: Conversation, previous: Stored | None) -> int:
    """What the row keeps of the conversation: its own items when it continues a chain by reference, the
    whole conversation when it stores it flattened (a first response, or a chain MAX_DEPTH deep)."""
    flattened = previous is None or previous.depth >= MAX_DEPTH
    return (conversation if flattened else Conversation([], conversation.items)).size()


def _storage_estimate(renderer: ResponsesRenderer, plan: RequestPlan) -> int:
    """Bytes the stored row may take: the response object as created, what its end adds (status, usage, the
    output's items), OUTPUT_BYTES_PER_TOKEN for each output token it may write, and the conversation it
    stores itself (its own items when it continues a chain by reference)."""
    items = _stored_items_size(renderer.conversation, renderer.previous)
    created = len(json.dumps(renderer.response.model_dump(), separators=(",", ":")))
    max_out = plan.params.max_tokens
    if max_out is None:  # runs to the context's end
        max_out = plan.target.base.max_model_len - plan.longest_prompt
    return items + created + ENDED_BYTES + OUTPUT_BYTES_PER_TOKEN * max_out


def _created(body: ResponseRequest, request_id: str) -> ResponseObject:
    """The response as it starts: in progress, no output, the request's settings echoed."""
    fmt = body.text.format if body.text is not None else None
    choice = body.tool_choice
    return ResponseObject(
        id=f"resp_{request_id.removeprefix('req_')}",
        created_at=int(time.time()),
        status="in_progress",
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        model=body.model,
        output=[],
        parallel_tool_calls=body.parallel_tool_calls,
        previous_response_id=body.previous_response_id,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        tool_choice=choice.model_dump()
        if choice is not None and not isinstance(choice, str)
        else choice or "auto",
        tools=[t.model_dump(exclude_none=True) for t in body.tools or ()],
        text={
            "format": {"type": "text"} if fmt is None else fmt.model_dump(exclude_none=True, by_alias=True)
        },
        truncation=body.truncation,
        user=body.user,
        metadata=body.metadata or {},
        store=body.store,
        top_logprobs=body.top_logprobs or 0,  # echoed as OpenAI does; no-ops here (app/schemas/extensions.py)
        safety_identifier=body.safety_identifier,
        prompt_cache_key=body.prompt_cache_key,
        reasoning=body.reasoning.model_dump(exclude_none=True) if body.reasoning is not None else None,
    )


async def _stored(services: Services, principal: Principal, response_id: str) -> Stored:
    stored = await run_in_threadpool(_store(services).get, principal.tenant_id, response_id)
    if stored is None:
        raise _missing(response_id)
    return stored


@router.get("/responses/{response_id}")
async def get_response(response_id: str, principal: ReaderDep, services: ServicesDep) -> JSONResponse:
    return JSONResponse((await _stored(services, principal, response_id)).body)


@router.delete("/responses/{response_id}")
async def delete_response(response_id: str, principal: ReaderDep, services: ServicesDep) -> JSONResponse:
    if not await run_in_threadpool(_store(services).delete, principal.tenant_id, response_id):
        raise _missing(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.get("/responses/{response_id}/input_items")
async def input_items(
    response_id: str,
    principal: ReaderDep,
    services: ServicesDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: Annotated[str | None, Query(max_length=256)] = None,
) -> JSONResponse:
    """This response's own input items (not its chain's), newest first unless order is asc."""
    items = (await _stored(services, principal, response_id)).input_items
    if order == "desc":
        items = items[::-1]
    if after is not None:
        ids = [item.get("id") for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    page = items[:limit]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )
