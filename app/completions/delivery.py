"""Delivery: a request's lifecycle answered over HTTP, in any API's shape: one whole JSON body, or one
server-sent event stream, the renderer deciding what each output looks like.

Shaping an output is done in the thread pool when the renderer calls it heavy; the events of one output
go out as one write. A stream that ends early (client gone, cancellation, engine failure) closes its
lifecycle, which stops the engine request and bills what it did.
"""

from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from app.completions.closing_stream_response import ClosingStreamingResponse
from app.completions.engine_stream import uncancellable
from app.completions.lifecycle import RequestLifecycle
from app.completions.rendering import Renderer
from app.metering.request_record import RequestStatus
from deployments.engine.interface import EngineError, FinishReason, RequestFailed, RequestOutput

T = TypeVar("T")
STREAM_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


async def respond(
    life: RequestLifecycle, renderer: Renderer, *, stream: bool
) -> JSONResponse | StreamingResponse:
    first = await life.start()
    if stream:
        life.lease_until_delivered = True

        async def closed() -> None:
            await life.close("aborted")  # a no-op when the stream ended by itself
            await life.delivered()  # the lease, kept until the proxy acknowledged the whole stream

        return ClosingStreamingResponse(
            _events(life, renderer, first),
            media_type="text/event-stream",
            headers={**STREAM_HEADERS, **life.headers()},
            on_close=closed,
        )
    return await _whole(life, renderer, first)


async def _shaped(heavy: bool, work: Callable[..., T], *args: Any) -> T:
    return await run_in_threadpool(work, *args) if heavy else work(*args)


async def _whole(life: RequestLifecycle, renderer: Renderer, first: RequestOutput) -> JSONResponse:
    body, heavy = await _whole_body(life, renderer, first)
    # A JSONResponse renders its bytes as it is made: heavy bodies render off the loop too.
    return await _shaped(heavy, _json, body, life.headers())


async def whole_body(life: RequestLifecycle, renderer: Renderer) -> dict[str, Any]:
    """The request run to its end and answered as one JSON body, without HTTP (a Batch API line); a
    refusal or a failure raises the APIError the route would have answered with."""
    first = await life.start()
    return (await _whole_body(life, renderer, first))[0]


async def _whole_body(
    life: RequestLifecycle, renderer: Renderer, first: RequestOutput
) -> tuple[dict[str, Any], bool]:
    """The body, and whether it is heavy to render."""
    last = first
    failed: RequestOutput | None = None
    try:
        out = first
        while True:
            if out.request_id != last.request_id:  # run again after a lost replica: start over
                renderer.reset()
            last = out
            if out.finish_reason is FinishReason.ERROR:
                failed = out
            await _shaped(renderer.heavy(out), renderer.add, out)
            if out.finished:
                break
            out = await life.next_output()
    except BaseException as stopped:
        await uncancellable(life.close("failed" if isinstance(stopped, EngineError) else "aborted"))
        raise
    if failed is not None:
        await uncancellable(life.close("failed"))
        raise await life.api_error(failed.error or RequestFailed())
    await uncancellable(life.close("completed"))
    heavy = renderer.heavy()
    return await renderer.keep(await _shaped(heavy, renderer.body, last)), heavy


def _json(body: dict[str, Any], headers: dict[str, str]) -> JSONResponse:
    return JSONResponse(body, headers=headers)


async def _events(life: RequestLifecycle, renderer: Renderer, first: RequestOutput) -> AsyncIterator[str]:
    last = first
    status: RequestStatus = "aborted"
    # Until the first event is written, a lost replica still runs the request again elsewhere (the
    # lifecycle's failover): an output under a new engine id is that restart, and the stream starts over.
    # The failover reads `client_has_output` only while outputs still come, so only the loop's write sets it.
    opening: list[str] = []
    try:
        opening = renderer.opening(first)
        out: RequestOutput | None = first
        while out is not None:
            if out.request_id != last.request_id:
                renderer.reset()
                opening = renderer.opening(out)
            last = out
            if out.finish_reason is FinishReason.ERROR:
                status = "failed"
                await life.written()
                yield "".join(opening + renderer.failure(out.error or RequestFailed()))
                return
            events = await _shaped(renderer.heavy(out), renderer.events, out)
            if opening:
                events, opening = opening + events, []
            if out.finished:  # before the client can see the end and send its next request
                await life.written()
            if events:
                life.client_has_output = True
                yield "".join(events)
            out = None if out.finished else await life.next_output()
        status = "completed"
        yield "".join(opening + await renderer.closing(last))
    except EngineError as error:  # e.g. the replica died mid-stream: say so in the stream, then end it
        status = "failed"
        await life.written()
        yield "".join(opening + renderer.failure(error))
    finally:
        # Leaving early (client gone, cancellation) stops the engine request and bills what it did.
        await uncancellable(life.close(status))
