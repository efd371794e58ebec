"""Bogus keys and expensive reads, through the real HTTP app: what they cost the database, and when they
get a 429 or a 503 instead of reaching it (issue 14, item 4); and last_used_at (item 13).

Each server here has its own settings (bare_serving); client addresses are told apart by calling from
different loopback addresses (127.0.0.2, 127.0.0.3).
"""

import secrets
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from billing.models import ApiKey
from tests.app.bare_serving import Bare, bare_serving, counting, key_lookups
from tests.model_fixtures import TinySetup

ERROR_KEYS = {"message", "type", "param", "code"}


def bogus_key() -> str:
    return f"sk-lp-{secrets.token_hex(6)}_{secrets.token_urlsafe(32)}"


def assert_error(r: httpx.Response, status: int, code: str) -> dict[str, str]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert body["error"]["code"] == code, body
    return dict(body["error"])


@pytest.fixture
def lenient(llama: TinySetup, tmp_path: Path) -> Iterator[Bare]:
    """Long cache TTL, no throttle in reach: only the caches stand between keys and the database."""
    with bare_serving(llama, tmp_path, auth_cache_ttl_s=30, auth_failure_limit=10_000) as bare:
        yield bare


def test_random_bogus_keys_cost_one_lookup_each(lenient: Bare) -> None:
    keys = [bogus_key() for _ in range(20)]
    with counting(lenient.engine, key_lookups) as lookups, lenient.client() as client:
        for key in keys * 3:  # each key three times
            r = client.get("/v1/models", headers={"authorization": f"Bearer {key}"})
            assert_error(r, 401, "invalid_api_key")
    assert len(lookups) == len(keys)  # before the negative cache: 60


def test_a_repeated_bogus_key_reaches_the_database_once_within_the_ttl(lenient: Bare) -> None:
    key = bogus_key()
    with counting(lenient.engine, key_lookups) as lookups, lenient.client(key) as client:
        for _ in range(25):
            assert_error(client.get("/v1/models"), 401, "invalid_api_key")
    assert len(lookups) == 1  # before: 25


def test_a_refused_key_is_retried_after_the_ttl(llama: TinySetup, tmp_path: Path) -> None:
    """The negative cache holds as long as the positive one: a key refused once is asked again after it."""
    with bare_serving(llama, tmp_path, auth_cache_ttl_s=0.3) as bare:
        key = bogus_key()
        with counting(bare.engine, key_lookups) as lookups, bare.client(key) as client:
            assert_error(client.get("/v1/models"), 401, "invalid_api_key")
            assert_error(client.get("/v1/models"), 401, "invalid_api_key")
            time.sleep(0.4)
            assert_error(client.get("/v1/models"), 401, "invalid_api_key")
        assert len(lookups) == 2


def test_a_flood_of_failed_keys_from_one_client_is_throttled_and_others_are_not(
    llama: TinySetup, tmp_path: Path
) -> None:
    with bare_serving(llama, tmp_path, auth_cache_ttl_s=30, auth_failure_limit=5) as bare:
        _, cached = bare.new_tenant("cached")
        _, fresh = bare.new_tenant("fresh")
        with bare.client(source="127.0.0.2") as attacker:
            cached_header = {"authorization": f"Bearer {cached}"}
            assert attacker.get("/v1/models", headers=cached_header).status_code == 200  # now cached
            with counting(bare.engine, key_lookups) as lookups:
                answers = [
                    attacker.get("/v1/models", headers={"authorization": f"Bearer {bogus_key()}"})
                    for _ in range(30)
                ]
            assert [r.status_code for r in answers[:5]] == [401] * 5
            for r in answers[5:]:
                error = assert_error(r, 429, "too_many_failed_authentications")
                assert 1 <= int(r.headers["retry-after"]) <= 60
                assert "invalid API keys" in error["message"]
            assert len(lookups) == 5  # the throttled ones never reached the database (before: 30)
            # A key already known valid still works from there: nothing new to look up.
            assert attacker.get("/v1/models", headers=cached_header).status_code == 200
        with bare.client(fresh, source="127.0.0.3") as bystander:
            assert bystander.get("/v1/models").status_code == 200
            assert bystander.get("/v1/limits").status_code == 200


def test_reads_have_a_per_tenant_budget(llama: TinySetup, tmp_path: Path) -> None:
    with bare_serving(llama, tmp_path, read_rpm=6, read_burst=3) as bare:
        _, key = bare.new_tenant("reader")
        _, other = bare.new_tenant("other-reader")
        usage = {"start": "2024-01-01T00:00:00Z", "end": "2024-04-03T00:00:00Z"}  # 93 days
        with bare.client(key) as client:
            assert client.get("/v1/usage", params=usage).status_code == 200
            assert client.get("/v1/models").status_code == 200
            assert client.get("/v1/limits").status_code == 200
            for path, params in (("/v1/usage", usage), ("/v1/models", {}), ("/v1/limits", {})):
                r = client.get(path, params=params)
                error = assert_error(r, 429, "rate_limit_exceeded")
                assert "6 per minute" in error["message"]
                assert 1 <= int(r.headers["retry-after"]) <= 10
                assert 0 < int(r.headers["retry-after-ms"]) <= 10_000
        with bare.client(other) as client:  # another tenant's budget is its own
            assert client.get("/v1/models").status_code == 200


def test_an_exhausted_connection_pool_is_a_503_with_retry_after(llama: TinySetup, tmp_path: Path) -> None:
    pool = {"size": 1, "max_overflow": 0, "timeout_s": 0.3}  # one connection, a short wait for it
    with bare_serving(llama, tmp_path, database_pool=pool, auth_cache_ttl_s=30) as bare:
        _, key = bare.new_tenant("pooled")
        with bare.client(key) as client:
            assert client.get("/v1/models").status_code == 200  # the key is cached now
            time.sleep(0.2)  # let the last_used_at write give its connection back
            held = bare.engine.connect()  # the pool's only connection
            try:
                params = {"start": "2024-01-01T00:00:00Z", "end": "2024-01-02T00:00:00Z"}
                r = client.get("/v1/usage", params=params)
            finally:
                held.close()
            error = assert_error(r, 503, "database_busy")  # before: 500 internal_error
            assert error["type"] == "server_error"
            assert r.headers["retry-after"] == "1"
            assert client.get("/v1/usage", params=params).status_code == 200  # and it recovers


def _last_used(bare: Bare, key: str) -> datetime | None:
    with bare.services.session_factory() as session:
        prefix = key[6:18]
        return session.scalars(select(ApiKey.last_used_at).where(ApiKey.prefix == prefix)).one()


def _wait_last_used(bare: Bare, key: str) -> datetime:
    deadline = time.monotonic() + 5
    while (found := _last_used(bare, key)) is None:
        assert time.monotonic() < deadline, "last_used_at was never written"
        time.sleep(0.05)
    return found


def test_last_used_at_is_written_once_per_interval_off_the_request_path(
    llama: TinySetup, tmp_path: Path
) -> None:
    with bare_serving(llama, tmp_path, auth_cache_ttl_s=0.1, key_last_used_interval_s=60) as bare:
        _, key = bare.new_tenant("user")
        assert _last_used(bare, key) is None
        with bare.client(key) as client:
            assert client.get("/v1/models").status_code == 200
            first = _wait_last_used(bare, key)  # before: never set
            with counting(
                bare.engine, lambda sql: sql.lstrip().upper().startswith("UPDATE api_keys".upper())
            ) as writes:
                for _ in range(10):
                    assert client.get("/v1/models").status_code == 200
                    time.sleep(0.02)
                time.sleep(0.3)
            assert writes == []  # not a write per request
        assert _last_used(bare, key) == first


def test_last_used_at_moves_on_after_the_interval(llama: TinySetup, tmp_path: Path) -> None:
    with bare_serving(llama, tmp_path, key_last_used_interval_s=0.3) as bare:
        _, key = bare.new_tenant("user")
        with bare.client(key) as client:
            assert client.get("/v1/models").status_code == 200
            first = _wait_last_used(bare, key)
            time.sleep(0.4)
            assert client.get("/v1/models").status_code == 200
            deadline = time.monotonic() + 5
            while (later := _last_used(bare, key)) == first:
                assert time.monotonic() < deadline, "last_used_at did not move on"
                time.sleep(0.05)
        assert later is not None and later > first


def test_a_slow_database_write_does_not_hold_up_requests(llama: TinySetup, tmp_path: Path) -> None:
    """The last_used_at write happens on another thread: a request never waits for it."""
    with bare_serving(llama, tmp_path, auth_cache_ttl_s=30) as bare:
        _, key = bare.new_tenant("patient")
        gate = threading.Event()
        real = bare.services.authenticator._key_usage._write  # type: ignore[union-attr]

        def stuck_write(batch: dict[str, datetime]) -> None:
            gate.wait(10)
            real(batch)

        bare.services.authenticator._key_usage._write = stuck_write  # type: ignore[union-attr,method-assign]
        try:
            with bare.client(key) as client:
                started = time.monotonic()
                assert client.get("/v1/models").status_code == 200
                assert time.monotonic() - started < 2
            assert _last_used(bare, key) is None
        finally:
            gate.set()
        _wait_last_used(bare, key)
