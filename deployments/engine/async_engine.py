"""AsyncEngine: runs LLMEngine.step() in a dedicated thread and streams outputs to asyncio callers.

The forward pass is long CPU/GPU work; keeping it off the event loop keeps the replica responsive
(health checks, new requests, aborts). The engine's state (scheduler, KV blocks, adapter tiers) belongs to
that loop thread alone: callers on other threads hand it jobs through an inbox (`run_on_loop`, `call`, the
adapter operations), and read its load and residency from a snapshot the loop publishes after every
iteration (`stats`). Outputs come back through per-request asyncio queues on the caller's loop. Leaving
`generate()` early (client disconnect, cancellation) aborts the request, so no generation is orphaned.

The loop thread never waits on the adapter store: a request's adapter config is read (and cached) before
the request is queued, on a thread of its own, and weights load on the adapter tiers' threads. Whatever
goes wrong for one request, on any thread, ends that request with a named error and never the loop.
"""

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import TypeVar

import torch

from adapters.ref import AdapterRef
from adapters.registered_digest import DigestSource
from deployments.engine.adapter_tiers.manager import AdapterManager
from deployments.engine.config import EngineConfig
from deployments.engine.cpu_features import engine_threads
from deployments.engine.errors import (
    DuplicateRequestId,
    EngineStopped,
    RequestError,
    RequestFailed,
)
from deployments.engine.grammar.grammars import Grammars
from deployments.engine.llm_engine import LLMEngine
from deployments.engine.model.model_loader import LoadedModel
from deployments.engine.outputs import EngineStats, RequestOutput, joined
from deployments.engine.request import EngineRequest
from deployments.engine.sequence import Sequence, attach_grammar

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    whole: bool = False  # EngineRequest.whole: each choice's output once it ends
    held: dict[int, list[RequestOutput]] = field(default_factory=dict)  # by choice; the loop thread's

    def ready(self, out: RequestOutput) -> list[RequestOutput]:
        """What to deliver of `out` now: all of it, or for a `whole` request each choice once it ends
        (the request's end brings whatever it still holds, e.g. of choices an abort cut short)."""
        if not self.whole:
            return [out]
        if out.finish_reason is None and not out.finished:
            self.held.setdefault(out.index, []).append(out)
            return []
        mine = joined([*self.held.pop(out.index, []), out])
        if not out.finished:
            return [mine]
        rest = [joined(outputs) for outputs in self.held.values()]
        self.held.clear()
        return [*rest, mine]


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        loaded: LoadedModel | None = None,
        replica_name: str | None = None,
        adapter_digests: DigestSource | None = None,
    ) -> None:
        threads = engine_threads(config.cpu_threads)
        if torch.get_num_threads() != threads:  # process-wide: this engine's process serves it
            log.info("torch intra-op threads: %d -> %d", torch.get_num_threads(), threads)
            torch.set_num_threads(threads)
        self._engine = LLMEngine(
            config, loaded=loaded, replica_name=replica_name, adapter_digests=adapter_digests
        )
        self._engine.adapters.on_loaded = self._wake
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopped = threading.Event()
        self._error: BaseException | None = None
        self._stats = self._engine.stats()  # replaced by the loop thread, read by anyone
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def config(self) -> EngineConfig:
        return self._engine.config

    @property
    def replica_name(self) -> str:
        return self._engine.replica_name

    @property
    def grammars(self) -> Grammars:
        """The engine's structured output: compiles off the loop thread, bounded (thread-safe)."""
        return self._engine.grammars

    @property
    def adapters(self) -> AdapterManager:
        """The engine's adapter tiers, for reading their counters (load times, loads); the loop thread owns
        them: change them through the adapter operations below or `run_on_loop`."""
        return self._engine.adapters

    @property
    def error(self) -> BaseException | None:
        """Why the loop died, if it did (Serve's health check restarts the replica then)."""
        return self._error

    async def generate(self, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        """Stream outputs for one request. Bad input raises before the first yield."""
        self._check_running()
        request_id = request.request_id
        if request_id in self._streams:
            raise DuplicateRequestId(request_id)
        seqs = self._engine.make_sequences(request)
        if request.params.structured is not None:  # compiled before queueing: a bad schema is refused here
            grammar = await self.grammars.compile_bounded(request.params.structured, request.tenant)
            attach_grammar(seqs, grammar)
        if request.adapter is not None:  # checked before queueing: an unservable adapter is refused here
            await self._check_adapter(request.adapter)
        if request_id in self._streams:
            raise DuplicateRequestId(request_id)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), whole=request.whole)
        self._streams[request_id] = stream
        self._submit(lambda: self._add(seqs, announce=request.announce))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # refused, or the engine stopped: nothing left to abort
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the caller went away: stop generating for it
                self._submit(lambda: void(self._abort(request_id)))

    async def _check_adapter(self, ref: AdapterRef) -> None:
        """Whether this engine can serve `ref`: its config comes from the spec cache, or is read from the
        store on the spec reader's threads (shared by concurrent requests for it); this request alone
        waits for it. Raises the adapter's named error."""
        adapters = self._engine.adapters
        spec = adapters.specs.cached(ref)
        if spec is None:  # shielded: this caller leaving must not cancel a read others share
            spec = await asyncio.shield(asyncio.wrap_future(adapters.specs.fetch(ref)))
        adapters.check_spec(spec)

    async def abort(self, request_id: str) -> bool:
        """Stop a request; its stream then ends with an ABORT output carrying its usage. False if this
        engine does not hold it (never came, or already finished)."""
        return await self.call(lambda _: self._abort(request_id))

    def run_on_loop(self, fn: Callable[[LLMEngine], T]) -> "Future[T]":
        """Run `fn(engine)` on the loop thread between steps; the future holds its result or error. The
        way for other threads to read or change engine state."""
        future: Future[T] = Future()

        def job() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(self._engine))
            except Exception as error:
                future.set_exception(error)

        self._check_running()
        self._submit(job)
        return future

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """`run_on_loop`, awaited from asyncio."""
        return await asyncio.wrap_future(self.run_on_loop(fn))

    # Adapter operations run on the loop thread between steps; errors (a ref that vanished) are logged.

    def pin_adapter(self, ref: AdapterRef) -> None:
        self._submit(self._logged(lambda: self._engine.adapters.pin(ref), f"pin {ref}"))

    def unpin_adapter(self, ref: AdapterRef) -> None:
        self._submit(lambda: self._engine.adapters.unpin(ref))

    def remove_adapter(self, adapter_id: str) -> None:
        self._submit(lambda: self._engine.adapters.remove(adapter_id))

    def prefetch_adapter(self, ref: AdapterRef) -> None:
        # Only starts the load; reading the files happens in the adapter loader's threads.
        self._submit(self._logged(lambda: self._engine.adapters.prefetch(ref), f"prefetch {ref}"))

    def reconcile_adapters(
        self, *, live: set[str], pinned: set[AdapterRef], prefetch: list[AdapterRef]
    ) -> "Future[None]":
        """AdapterManager.reconcile on the loop thread (the registry watcher's one way in)."""
        return self.run_on_loop(lambda e: e.adapters.reconcile(live=live, pinned=pinned, prefetch=prefetch))

    @staticmethod
    def _logged(job: Callable[[], object], what: str) -> Callable[[], None]:
        def run() -> None:
            try:
                job()
            except Exception as error:
                log.warning("%s failed: %s", what, error)

        return run

    def stats(self) -> EngineStats:
        """Load and residency as of the loop's last iteration (a snapshot: safe from any thread). Grammar
        refusals are counted live: they happen on callers' threads, before a request reaches the loop, and
        an idle loop refreshes its snapshot only once a second."""
        return replace(self._stats, grammar_refusals=self.grammars.refusals())

    @property
    def running(self) -> bool:
        """The model is loaded (construction did that) and the loop is taking requests."""
        return not self._stopped.is_set() and self._error is None and self._thread.is_alive()

    def shutdown(self) -> None:
        self._stopped.set()
        self._wake()
        self._thread.join(timeout=30)
        self._engine.close()  # the grammar threads first, then the adapter tiers

    # -- loop thread ----------------------------------------------------------------------------------

    def _submit(self, job: Callable[[], None]) -> None:
        self._inbox.put(job)
        self._wake()

    def _wake(self) -> None:
        self._wakeup.set()

    def _check_running(self) -> None:
        if self._stopped.is_set() or self._error is not None:
            raise EngineStopped(f"engine is not running: {self._error or 'shut down'}")

    def _add(self, seqs: list[Sequence], *, announce: bool) -> None:
        request_id = seqs[0].group_id
        stream = self._streams.get(request_id)
        if stream is None:  # cancelled before it reached the loop
            return
        try:
            self._engine.add_sequences(seqs)
        except Exception as error:  # refused (overloaded) or broken: only this request ends
            refusal: RequestError
            if isinstance(error, RequestError):
                refusal = error
            else:
                log.exception("request %s: queueing it failed", request_id)
                self._forget(request_id)
                refusal = RequestFailed()
            del self._streams[request_id]
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, refusal)
            return
        if announce:
            accepted = RequestOutput(request_id, "", usage=self._engine.usage_of(seqs), accepted=True)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, accepted)

    def _forget(self, request_id: str) -> None:
        """Take out whatever part of a request its failed queueing left in the engine."""
        try:
            self._engine.abort(request_id)
        except Exception:
            log.exception("request %s: cleaning up after it failed", request_id)

    def _abort(self, request_id: str) -> bool:
        outputs = self._engine.abort(request_id)
        self._deliver(outputs)
        return bool(outputs)

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._drain_inbox()
                self._engine.adapters.load_pinned()  # also when idle: a pin takes its slot right away
                busy = self._engine.has_unfinished()
                outputs = self._engine.step() if busy else []
                self._stats = self._engine.stats()  # before delivering: a caller who saw an output sees this
                if outputs:
                    self._deliver(outputs)
                if (not busy or self._engine.counters.last_step_tokens == 0) and self._inbox.empty():
                    # Idle, or every waiting request waits on an adapter load: sleep until woken.
                    self._wakeup.wait(timeout=0.05 if busy else 1.0)
                    self._wakeup.clear()
        except BaseException as error:  # a bug in the loop: fail every stream rather than hang them
            log.exception("engine loop died")
            self._error = error
            for stream in list(self._streams.values()):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, EngineStopped(str(error)))

    def _drain_inbox(self) -> None:
        while True:
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                job()
            except Exception:  # one job's failure (an abort, an adapter operation) is not the loop's
                log.exception("engine loop job failed")

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            ready = stream.ready(out)
            if ready:
                by_loop.setdefault(stream.loop, []).extend((stream, r) for r in ready)
        for loop, items in by_loop.items():  # one thread hop per event loop per step
            loop.call_soon_threadsafe(_put_all, items)


def void(_: object) -> None:
    """Drop a job's result (the inbox takes jobs returning None)."""


def _put_all(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.queue.put_nowait(out)
