"""The waiting queue's fair share: while other tenants wait, one tenant's waiting sequences (every choice of
every prompt) take at most half of max_waiting; alone, a tenant may fill it. Refusals are
QueueShareExceeded, an EngineOverloaded that the HTTP layer answers with a 429 of its own."""

import pytest

from app.errors import to_api_error
from deployments.engine.interface import EngineOverloaded, EngineRequest, QueueShareExceeded, SamplingParams
from tests.engine.helpers import drain, make_engine
from tests.model_fixtures import TinySetup

PROMPT = [1, 2, 3, 4, 5]


def _request(rid: str, tenant: str | None, n: int = 1) -> EngineRequest:
    return EngineRequest(rid, PROMPT, SamplingParams(max_tokens=2, n=n), cache_salt=tenant, tenant=tenant)


def test_one_tenant_takes_at_most_half_the_queue_while_others_wait(llama: TinySetup) -> None:
    engine = make_engine(llama, max_waiting=8)
    engine.add_request(_request("a1", "a", n=6))  # alone: more than half is fine
    engine.add_request(_request("b1", "b", n=2))  # the queue is full now
    with pytest.raises(EngineOverloaded):
        engine.add_request(_request("c1", "c"))
    while engine.scheduler.waiting:  # the leaders' prefills, then their other choices: everyone runs
        engine.step()

    engine.add_request(_request("a2", "a", n=3))
    engine.add_request(_request("b2", "b"))
    with pytest.raises(QueueShareExceeded):  # a would hold 5 of 8 while b waits
        engine.add_request(_request("a3", "a", n=2))
    engine.add_request(_request("a4", "a"))  # 4 of 8: its half
    with pytest.raises(QueueShareExceeded):
        engine.add_request(_request("a5", "a"))
    engine.add_request(_request("b3", "b", n=3))  # b gets its half too
    assert engine.scheduler.waiting_of("a") == engine.scheduler.waiting_of("b") == 4
    outputs = drain(engine)
    assert {"a2", "a4", "b2", "b3"} <= set(outputs) and "a3" not in outputs and "a5" not in outputs
    assert engine.scheduler.waiting_of("a") == 0 and not engine.has_unfinished()
    engine.close()


def test_a_share_refusal_is_a_429_without_internals() -> None:
    error = to_api_error(QueueShareExceeded("tenant 'ten_123' has 2048 of 2050 waiting sequences"))
    assert error.status == 429 and error.code == "queue_share_exceeded"
    assert "ten_123" not in error.message and "2048" not in error.message
    assert error.headers.get("retry-after") == "1"
