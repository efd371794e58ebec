"""GrammarPool: tenants take turns on the grammar threads, one tenant never holds them all, the queue and
each tenant's part of it are bounded, and equal requests share one compile."""

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from deployments.engine.errors import EngineOverloaded
from deployments.engine.grammar.pool import GrammarPool

WAIT_S = 10.0  # only ever reached when a test fails


class Gate:
    """Jobs that record when they run and block until opened."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.ran: list[str] = []
        self._lock = threading.Lock()

    def job(self, name: str, *, blocks: bool = True) -> Callable[[], str]:
        def run() -> str:
            with self._lock:
                self.ran.append(name)
            if blocks:
                assert self.opened.wait(WAIT_S)
            return name

        return run

    def wait_for(self, name: str) -> None:
        """Until the job `name` has started."""
        for _ in range(int(WAIT_S / 0.01)):
            with self._lock:
                if name in self.ran:
                    return
            time.sleep(0.01)
        raise AssertionError(f"{name} never started")


@pytest.fixture
def gate() -> Iterator[Gate]:
    gate = Gate()
    yield gate
    gate.opened.set()


def test_tenants_take_turns_on_the_threads(gate: Gate) -> None:
    pool: GrammarPool[str] = GrammarPool(threads=1, max_queued=16, tenant_share=8)
    first = pool.submit("a", 0, gate.job("a0"))
    gate.wait_for("a0")
    jobs = [pool.submit("a", i, gate.job(f"a{i}", blocks=False)) for i in (1, 2, 3)]
    jobs += [pool.submit("b", i, gate.job(f"b{i}", blocks=False)) for i in (0, 1)]  # after all of a's
    gate.opened.set()
    for job in [first, *jobs]:
        job.future.result(WAIT_S)
    # First come, first served would run a1, a2, a3 before b0.
    assert gate.ran == ["a0", "a1", "b0", "a2", "b1", "a3"]
    pool.shutdown()


def test_one_tenant_never_holds_every_thread(gate: Gate) -> None:
    pool: GrammarPool[str] = GrammarPool(threads=2, max_queued=16, tenant_share=8)
    slow = [pool.submit("a", i, gate.job(f"a{i}")) for i in range(3)]  # a's slow schemas
    gate.wait_for("a0")
    quick = pool.submit("b", 0, gate.job("b0", blocks=False))
    assert quick.future.result(WAIT_S) == "b0"  # while a's first compile still holds its thread
    assert not gate.opened.is_set() and gate.ran[0] == "a0" and "a1" not in gate.ran
    gate.opened.set()
    assert [job.future.result(WAIT_S) for job in slow] == ["a0", "a1", "a2"]
    pool.shutdown()


def test_a_full_queue_or_a_tenants_full_share_refuses_at_once(gate: Gate) -> None:
    pool: GrammarPool[str] = GrammarPool(threads=2, max_queued=3, tenant_share=2)
    pool.submit("a", 0, gate.job("a0"))
    pool.submit("b", 0, gate.job("b0"))
    gate.wait_for("a0")
    gate.wait_for("b0")  # both threads busy from here
    pool.submit("a", 1, gate.job("a1"))
    with pytest.raises(EngineOverloaded, match="tenant already has 2"):
        pool.submit("a", 2, gate.job("a2"))
    assert pool.submit("a", 1, gate.job("a1 again")).waiters == 2  # an equal spec joins, never refused
    pool.submit("c", 0, gate.job("c0"))
    pool.submit("d", 0, gate.job("d0"))
    assert pool.queued == 3
    with pytest.raises(EngineOverloaded, match="3 grammar compiles are already waiting"):
        pool.submit("e", 0, gate.job("e0"))
    assert not gate.opened.is_set()  # refused without waiting for anything
    pool.shutdown()


def test_the_last_waiter_to_leave_cancels_a_job_no_thread_took(gate: Gate) -> None:
    pool: GrammarPool[str] = GrammarPool(threads=1, max_queued=4, tenant_share=4)
    running = pool.submit("a", 0, gate.job("a0"))
    gate.wait_for("a0")
    queued = pool.submit("b", 0, gate.job("b0", blocks=False))
    assert pool.submit("b", 0, gate.job("unused")) is queued
    assert pool.leave(queued) and not queued.future.cancelled()  # another waiter still wants it
    assert pool.leave(queued) and queued.future.cancelled() and pool.queued == 0
    assert not pool.leave(running)  # it had started: it runs to its end
    gate.opened.set()
    assert running.future.result(WAIT_S) == "a0" and gate.ran == ["a0"]
    assert pool.submit("b", 0, gate.job("b0 again", blocks=False)).future.result(WAIT_S) == "b0 again"
    pool.shutdown()


def test_a_failing_job_fails_its_waiters_and_the_thread_goes_on() -> None:
    pool: GrammarPool[str] = GrammarPool(threads=1, max_queued=4, tenant_share=4)

    def broken() -> str:
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        pool.submit("a", 0, broken).future.result(WAIT_S)
    assert pool.submit("a", 0, lambda: "ok").future.result(WAIT_S) == "ok"
    pool.shutdown()
