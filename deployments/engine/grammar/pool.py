"""GrammarPool: a few threads that compile grammars, taking the tenants in turn.

A queue shared first come, first served lets one tenant that sends many new schemas at once put every other
tenant's compile behind all of them, past its time bound. Here each tenant has its own line; the threads
serve the lines in rotation, and one tenant runs on at most all threads but one: a compile waits for at most
one job of each other tenant with work queued, and never for a thread that one tenant's slow schemas hold.
The queue is bounded (`max_queued` jobs waiting for a thread, all tenants together) and so is each tenant's
part of it (`tenant_share` jobs, queued or running): past either bound a request is refused at once
(EngineOverloaded) instead of joining a wait it could not finish within its bound.

Requests for an equal spec of one tenant share one job: a burst of requests with the same new schema is
compiled once and counts once. A waiter that gives up (`leave`) cancels the job if it was the last one
waiting and no thread has taken it yet. Thread-safe; the threads start with the pool.
"""

import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from deployments.engine.errors import EngineOverloaded
from deployments.engine.grammar.cache import Tenant

T = TypeVar("T")


@dataclass(eq=False)
class CompileJob(Generic[T]):
    tenant: Tenant
    key: Hashable
    fn: Callable[[], T]
    future: "Future[T]" = field(default_factory=Future)
    waiters: int = 1
    started: bool = False  # a thread took it (set under the pool's lock)


class GrammarPool(Generic[T]):
    def __init__(self, *, threads: int, max_queued: int, tenant_share: int, name: str = "grammar") -> None:
        if threads < 1 or max_queued < 1 or tenant_share < 1:
            raise ValueError("threads, max_queued and tenant_share must be >= 1")
        self.max_queued = max_queued
        self.tenant_share = tenant_share
        self._cond = threading.Condition()
        self._lines: OrderedDict[Tenant, deque[CompileJob[T]]] = OrderedDict()  # in turn order
        self._jobs: dict[tuple[Tenant, Hashable], CompileJob[T]] = {}  # queued or running
        self._held: Counter[Tenant] = Counter()  # jobs queued or running, per tenant
        self._running: Counter[Tenant] = Counter()
        self._tenant_threads = max(1, threads - 1)  # a thread always left for the other tenants
        self._queued = 0
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, tenant: Tenant, key: Hashable, fn: Callable[[], T]) -> CompileJob[T]:
        """Queue `fn` on the tenant's line, or join the tenant's job for an equal `key` queued or running.
        Raises EngineOverloaded (nothing queued) when the queue or the tenant's share of it is full."""
        with self._cond:
            if self._closed:
                raise EngineOverloaded("the grammar pool is shut down")
            job = self._jobs.get((tenant, key))
            if job is not None:
                job.waiters += 1
                return job
            if self._queued >= self.max_queued:
                raise EngineOverloaded(f"{self._queued} grammar compiles are already waiting for a thread")
            if self._held[tenant] >= self.tenant_share:
                held = self._held[tenant]
                raise EngineOverloaded(f"this tenant already has {held} grammar compiles queued or running")
            job = CompileJob(tenant, key, fn)
            self._jobs[(tenant, key)] = job
            self._held[tenant] += 1
            self._lines.setdefault(tenant, deque()).append(job)
            self._queued += 1
            self._cond.notify()
            return job

    def leave(self, job: CompileJob[T]) -> bool:
        """One waiter stops waiting. True if the job never ran: no thread had taken it, and it is dropped
        now if this was its last waiter (its future is cancelled)."""
        with self._cond:
            job.waiters -= 1
            if job.started:
                return False
            if job.waiters <= 0 and self._jobs.get((job.tenant, job.key)) is job:
                line = self._lines[job.tenant]
                line.remove(job)
                if not line:
                    del self._lines[job.tenant]
                self._queued -= 1
                self._release(job)
                job.future.cancel()
            return True

    @property
    def queued(self) -> int:
        """Jobs waiting for a thread."""
        with self._cond:
            return self._queued

    def shutdown(self) -> None:
        """Stop taking jobs; queued ones are cancelled, running ones finish (compiles cannot be stopped)."""
        with self._cond:
            self._closed = True
            for line in self._lines.values():
                for job in line:
                    job.future.cancel()
            self._lines.clear()
            self._queued = 0
            self._cond.notify_all()

    def _work(self) -> None:
        while True:
            with self._cond:
                job = self._next()
                while job is None and not self._closed:
                    self._cond.wait()
                    job = self._next()
                if job is None:
                    return
            try:
                result = job.fn()
            except BaseException as error:  # delivered to the waiters; the thread goes on
                with self._cond:
                    self._finish(job)
                job.future.set_exception(error)
            else:
                with self._cond:
                    self._finish(job)
                job.future.set_result(result)

    def _next(self) -> CompileJob[T] | None:
        """Take the first job, in turn order, of a tenant below its thread cap (under the lock)."""
        if self._closed:
            return None
        ready = [t for t in self._lines if self._running[t] < self._tenant_threads][:1]
        if not ready:
            return None
        tenant = ready[0]
        line = self._lines.pop(tenant)
        job = line.popleft()
        if line:
            self._lines[tenant] = line  # to the back: every other tenant goes first
        self._queued -= 1
        self._running[tenant] += 1
        job.started = True
        return job

    def _finish(self, job: CompileJob[T]) -> None:
        self._running[job.tenant] -= 1
        if self._running[job.tenant] <= 0:
            del self._running[job.tenant]
        self._release(job)
        self._cond.notify_all()  # a thread may be waiting for this tenant's cap to free

    def _release(self, job: CompileJob[T]) -> None:
        del self._jobs[(job.tenant, job.key)]
        self._held[job.tenant] -= 1
        if self._held[job.tenant] <= 0:
            del self._held[job.tenant]
