"""A burst of one uncached key, through the real HTTP app: the concurrent requests share one database lookup
(issue 14, item 4: before, each request that arrived before the first lookup finished made its own), and a
lookup the database could not answer is shared as a 503, never remembered as a refusal."""

import contextlib
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import event

from tests.app.bare_serving import Bare, bare_serving, counting, key_lookups
from tests.model_fixtures import TinySetup

BURST = 12


def _burst(bare: Bare, key: str | None, size: int = BURST) -> list[httpx.Response]:
    def one(_: int) -> httpx.Response:
        with bare.client(key) as client:
            return client.get("/v1/models")

    with ThreadPoolExecutor(size) as pool:
        return list(pool.map(one, range(size)))


def _slow_lookups(bare: Bare) -> Any:
    """Every key lookup takes 0.5 s, so the burst's requests all arrive while the first is under way."""

    def before(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if key_lookups(statement):
            time.sleep(0.5)

    event.listen(bare.engine, "before_cursor_execute", before)
    return before


def test_a_burst_of_one_bogus_key_is_one_lookup(llama: TinySetup, tmp_path: Path) -> None:
    with bare_serving(llama, tmp_path, auth_cache_ttl_s=30, auth_failure_limit=10_000) as bare:
        key = f"sk-lp-{secrets.token_hex(6)}_{secrets.token_urlsafe(32)}"
        _slow_lookups(bare)
        with counting(bare.engine, key_lookups) as lookups:
            answers = _burst(bare, key)
        assert [r.status_code for r in answers] == [401] * BURST
        assert {r.json()["error"]["code"] for r in answers} == {"invalid_api_key"}
        assert len(lookups) == 1, len(lookups)  # before: one per request that overlapped the first


def test_a_burst_of_one_valid_key_is_one_lookup_and_all_succeed(llama: TinySetup, tmp_path: Path) -> None:
    with bare_serving(llama, tmp_path, auth_cache_ttl_s=30) as bare:
        _, key = bare.new_tenant("bursty")
        _slow_lookups(bare)
        with counting(bare.engine, key_lookups) as lookups:
            answers = _burst(bare, key)
        assert [r.status_code for r in answers] == [200] * BURST
        assert len(lookups) == 1, len(lookups)


def test_a_caller_going_away_does_not_fail_the_others(llama: TinySetup, tmp_path: Path) -> None:
    """The shared lookup is shielded: the first caller hanging up mid-lookup leaves it running."""
    with bare_serving(llama, tmp_path, auth_cache_ttl_s=30) as bare:
        _, key = bare.new_tenant("patient")
        _slow_lookups(bare)
        with (
            counting(bare.engine, key_lookups) as lookups,
            bare.client(key) as impatient,
            ThreadPoolExecutor(1) as pool,
        ):
            with contextlib.suppress(httpx.TimeoutException):
                impatient.get("/v1/models", timeout=0.1)
            later = pool.submit(_burst, bare, key, 1)
            assert [r.status_code for r in later.result()] == [200]
        assert len(lookups) == 1, len(lookups)


def test_a_lookup_the_database_could_not_answer_is_not_remembered(llama: TinySetup, tmp_path: Path) -> None:
    """A pool timeout during a shared lookup is a 503 for each caller sharing it, and neither a refusal
    cached nor a failure counted against the client: the same key works once a connection is free."""
    pool = {"size": 1, "max_overflow": 0, "timeout_s": 0.3}
    with bare_serving(llama, tmp_path, database_pool=pool, auth_cache_ttl_s=30, auth_failure_limit=1) as bare:
        _, key = bare.new_tenant("unlucky")
        time.sleep(0.2)  # the admin calls' connection back in the pool
        held = bare.engine.connect()  # the pool's only connection
        try:
            answers = _burst(bare, key, 4)
        finally:
            held.close()
        for r in answers:
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "database_busy" and r.headers["retry-after"] == "1"
        assert [r.status_code for r in _burst(bare, key, 2)] == [200, 200]
